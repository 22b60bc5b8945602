"""`relay run` as a user runs it: formats, OpenAI lines, errors, exit codes, resume after kill -9."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

SYSTEM = "You are Bolt, a hardware-store assistant. Answer in one short sentence. Screws are in aisle 4."
QUESTIONS = ["Where are the screws?", "Do you sell paint?", "What time do you close?", "hi",
             "Can I return a drill?", "Do you cut keys?", "Is parking free?", "What is a hex key?"]


def relay(*args, check=True, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from relaycli.cli import entry; entry()", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"relay {' '.join(map(str, args))} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    (d / "sys.txt").write_text(SYSTEM)
    relay("compile-prompt", d / "sys.txt", "--quiet")
    rows = [{"id": f"q{i}", "prompt": q, "max_tokens": 8, "temperature": 0} for i, q in enumerate(QUESTIONS)]
    rows.insert(3, {"id": "bad-type", "prompt": 7})
    with open(d / "reqs.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write("{not json\n")
    return d


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_jsonl_in_parquet_out_with_error_rows_and_stats(job, tmp_path):
    out = tmp_path / "out.parquet"
    stats = tmp_path / "stats.json"
    res = relay("run", "--in", job / "reqs.jsonl", "--out", out, "--prompt", job / "sys.relaykv",
                "--stats-json", stats)
    table = pq.read_table(out)
    assert table.column_names == ["id", "text", "finish_reason", "prompt_tokens", "cached_tokens",
                                  "completion_tokens", "error", "logprobs", "completions"]
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["q0", "q1", "q2", "bad-type", "q3", "q4", "q5", "q6", "q7", "9"]
    assert rows[3]["finish_reason"] == "error" and "'prompt' must be a string" in rows[3]["error"]
    assert rows[9]["finish_reason"] == "error" and "not valid JSON" in rows[9]["error"]
    good = [r for r in rows if r["finish_reason"] != "error"]
    assert all(r["text"] and r["cached_tokens"] > 20 and r["error"] is None for r in good)
    s = json.loads(stats.read_text())
    assert s["stats"]["rows"] == 10 and s["stats"]["errors"] == 2 and s["stats"]["prefix_hits"] == 8
    assert "prefix hits" in res.stderr  # the summary table
    failing = relay("run", "--in", job / "reqs.jsonl", "--out", tmp_path / "again.jsonl", "--prompt",
                    job / "sys.relaykv", "--fail-on-error", "--quiet", check=False)
    assert failing.returncode == 1 and "2 rows of" in failing.stderr and "error rows" in failing.stderr
    # A finished output still counts its error rows when --resume finds nothing to do.
    again = relay("run", "--in", job / "reqs.jsonl", "--out", out, "--prompt", job / "sys.relaykv", "--resume",
                  "--fail-on-error", check=False)
    assert again.returncode == 1 and "already complete (10 rows, 2 error rows)" in again.stderr
    assert "2 rows of" in again.stderr


def test_resume_refuses_an_output_cut_short_or_of_another_input(job, tmp_path):
    src, out = tmp_path / "r.jsonl", tmp_path / "o.jsonl"
    lines = [json.dumps({"id": f"k{i}", "prompt": q, "max_tokens": 3, "temperature": 0}) + "\n"
             for i, q in enumerate(QUESTIONS[:4])]
    src.write_text("".join(lines))
    args = ["run", "--in", src, "--out", out, "--prompt", job / "sys.relaykv", "--quiet"]
    relay(*args)
    done = out.read_text()
    out.write_text("".join(done.splitlines(keepends=True)[:2]))  # a copy that was cut short
    res = relay(*args, "--resume", check=False)
    assert res.returncode == 2 and "holds 2 rows but the input has 4: it was cut short" in res.stderr
    out.write_text(done)
    src.write_text("".join(lines[:2] + [lines[3], lines[2]]))  # another input, same length
    res = relay(*args, "--resume", check=False)
    assert res.returncode == 2 and "row 2 of" in res.stderr and "belongs to another job" in res.stderr
    # Parts of an interrupted job are tied to its input's bytes.
    out.unlink()
    parts = Path(str(out) + ".parts")
    parts.mkdir()
    (parts / "job.json").write_text(json.dumps({"input_sha256": "0" * 64}))
    res = relay(*args, "--resume", check=False)
    assert res.returncode == 2 and "holds answers of another job: the input file changed since" in res.stderr
    assert not out.exists()


def test_rows_with_lone_surrogates_are_error_rows_and_the_job_goes_on(job, tmp_path):
    src, out = tmp_path / "r.jsonl", tmp_path / "o.jsonl"
    # "\ud800" is valid JSON but not text: it must stop at its own row, not kill the job.
    src.write_text('{"id": "fine", "prompt": "hi", "max_tokens": 3, "temperature": 0}\n'
                   '{"id": "s1", "prompt": "a\\ud800b"}\n'
                   '{"id": "\\udfff", "prompt": "hi"}\n')
    relay("run", "--in", src, "--out", out, "--prompt", job / "sys.relaykv", "--quiet")
    rows = _jsonl(out)
    assert [r["id"] for r in rows] == ["fine", "s1", "2"]
    assert rows[0]["finish_reason"] != "error"
    assert "'prompt' holds a lone surrogate" in rows[1]["error"] and "'id' holds a lone surrogate" in rows[2]["error"]


def test_paths_a_job_would_destroy_are_refused(job, tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "max_tokens": 2}) + "\n")
    before = src.read_bytes()
    for extra in ([], ["--resume"]):
        res = relay("run", "--in", src, "--out", src, *extra, check=False)
        assert res.returncode == 2 and "is the input file" in res.stderr, res.stderr
    out = tmp_path / "o.jsonl"
    res = relay("run", "--in", src, "--out", out, "--stats-json", out, check=False)
    assert res.returncode == 2 and "--stats-json" in res.stderr and "is the --out file" in res.stderr
    res = relay("run", "--in", src, "--out", out, "--stats-json", src, check=False)
    assert res.returncode == 2 and "is the input file" in res.stderr
    art = tmp_path / "keep.relaykv"
    art.write_bytes((job / "sys.relaykv").read_bytes())
    res = relay("run", "--in", src, "--out", out, "--prompt", art, "--stats-json", art, check=False)
    assert res.returncode == 2 and "is the --prompt artifact" in res.stderr
    assert art.read_bytes() == (job / "sys.relaykv").read_bytes()
    art.unlink()
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


def test_parquet_in_jsonl_out_and_no_relay_agree(job, tmp_path):
    rows = [json.loads(line) for line in (job / "reqs.jsonl").read_text().splitlines()[:3]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "reqs.parquet")
    relay("run", "--in", tmp_path / "reqs.parquet", "--out", tmp_path / "a.jsonl", "--prompt", job / "sys.relaykv", "--quiet")
    relay("run", "--in", tmp_path / "reqs.parquet", "--out", tmp_path / "b.jsonl", "--prompt", job / "sys.relaykv",
          "--quiet", "--no-relay")
    a, b = _jsonl(tmp_path / "a.jsonl"), _jsonl(tmp_path / "b.jsonl")
    assert [r["id"] for r in a] == ["q0", "q1", "q2"] and a == b


def test_openai_batch_in_and_out(job, tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "x", "messages": [{"role": "user", "content": q}], "max_tokens": 6, "temperature": 0}}
             for i, q in enumerate(QUESTIONS[:3])]
    lines.append({"custom_id": "c-bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}})
    src = tmp_path / "batch.jsonl"
    # An unreadable first line must not switch the whole output to relay's row format.
    src.write_text("{cut off\n" + "".join(json.dumps(x) + "\n" for x in lines))
    relay("run", "--in", src, "--out", tmp_path / "out.jsonl", "--prompt", job / "sys.relaykv", "--quiet")
    out = _jsonl(tmp_path / "out.jsonl")[1:]
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2", "c-bad"]
    ok = out[0]["response"]
    assert ok["status_code"] == 200 and ok["body"]["choices"][0]["message"]["content"]
    assert ok["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
    assert out[3]["response"] is None and out[3]["error"]["message"]


def test_refusals_before_any_work(job, tmp_path):
    missing = relay("run", "--in", tmp_path / "nope.jsonl", "--out", tmp_path / "o.parquet", check=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr  # the error line, no empty progress bar
    bad_art = tmp_path / "bad.relaykv"
    bad_art.write_bytes((job / "sys.relaykv").read_bytes()[:1000])
    res = relay("run", "--in", job / "reqs.jsonl", "--out", tmp_path / "o.parquet", "--prompt", bad_art, check=False)
    assert res.returncode == 2 and "truncated" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # refused after the model loaded: still one line
    assert not (tmp_path / "o.parquet").exists()
    res = relay("run", "--in", job / "reqs.jsonl", "--out", tmp_path / "no" / "o.parquet", check=False)
    assert res.returncode == 2 and "does not exist" in res.stderr
    (tmp_path / "exists.parquet").write_bytes(b"x")
    res = relay("run", "--in", job / "reqs.jsonl", "--out", tmp_path / "exists.parquet", check=False)
    assert res.returncode == 2 and "--resume" in res.stderr
    # --stats-json is written at the end of a job: its folder is checked before the job starts
    res = relay("run", "--in", job / "reqs.jsonl", "--out", tmp_path / "s.parquet",
                "--stats-json", tmp_path / "no" / "s.json", check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "the --stats-json folder" in res.stderr and "does not exist" in res.stderr
    assert not (tmp_path / "s.parquet").exists()


def test_resume_after_kill_9_loses_and_doubles_nothing(job, tmp_path):
    n = 40
    rng = random.Random()
    src = tmp_path / "many.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"{rng.choice(QUESTIONS)} ({i})",
                                       "max_tokens": 4, "temperature": 0}) + "\n" for i in range(n)))
    out = tmp_path / "many.parquet"
    args = ["run", "--in", src, "--out", out, "--prompt", job / "sys.relaykv", "--max-batch", "4", "--quiet",
            "--flush-rows", "3"]
    cmd = [sys.executable, "-c", "from relaycli.cli import entry; entry()", *map(str, args)]
    killed_mid_job = 0
    for attempt in range(2):
        proc = subprocess.Popen(cmd + (["--resume"] if attempt else []),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        parts = Path(str(out) + ".parts")
        deadline = time.time() + 300
        # Kill at a random moment once some rows are saved, so the kill lands mid-job.
        want = rng.randint(1, 3)
        while time.time() < deadline and proc.poll() is None:
            if parts.is_dir() and len(list(parts.glob("part-*.parquet"))) >= want:
                time.sleep(rng.uniform(0, 1.5))
                break
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed_mid_job += not out.exists()
        proc.wait()
    assert killed_mid_job >= 1, "the job finished before any kill: the test proved nothing"
    relay(*args, "--resume")
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(n)]
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    fresh = tmp_path / "fresh.parquet"
    relay("run", "--in", src, "--out", fresh, "--prompt", job / "sys.relaykv", "--max-batch", "4", "--quiet")
    assert pq.read_table(fresh).to_pylist() == rows


STOP_AFTER_3 = """
import os, signal, sys
from relaycli.io import writer
real, signum = writer.ResultWriter.write, getattr(signal, sys.argv[1])
# as in a terminal, whatever launched the tests (a shell ignores SIGINT in background jobs)
signal.signal(signal.SIGINT, signal.default_int_handler)
def write(self, result):
    real(self, result)
    if len(self._done) == 3:
        os.kill(os.getpid(), signum)
writer.ResultWriter.write = write
sys.argv = ["relay", *sys.argv[2:]]
from relaycli.cli import entry
entry()
"""


IGNORED_SIGHUP = STOP_AFTER_3.replace("import os, signal, sys", "import os, signal, sys\n"
                                      "signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it")


def test_a_signal_ignored_before_the_job_stays_ignored(job, tmp_path):
    src, out = tmp_path / "r.jsonl", tmp_path / "o.jsonl"
    src.write_text("".join(json.dumps({"prompt": q, "max_tokens": 2, "temperature": 0}) + "\n"
                           for q in QUESTIONS[:4]))
    res = subprocess.run([sys.executable, "-c", IGNORED_SIGHUP, "SIGHUP", "run", "--in", str(src), "--out", str(out),
                          "--prompt", str(job / "sys.relaykv"), "--quiet"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    assert len(_jsonl(out)) == 4


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_save_every_finished_answer(job, tmp_path, signame):
    # timeout, systemd, Kubernetes and Slurm stop a job with SIGTERM: it must unwind as
    # Ctrl-C does, so the answers finished but not yet in a part are saved too.
    src, out = tmp_path / "r.jsonl", tmp_path / "o.jsonl"
    src.write_text("".join(json.dumps({"id": f"s{i}", "prompt": q, "max_tokens": 3, "temperature": 0}) + "\n"
                           for i, q in enumerate(QUESTIONS)))
    args = ["run", "--in", src, "--out", out, "--prompt", job / "sys.relaykv", "--quiet", "--max-batch", "1",
            "--flush-rows", "1000"]  # by rows, nothing is saved before the signal but by the unwinding
    res = subprocess.run([sys.executable, "-c", STOP_AFTER_3, signame, *map(str, args)], capture_output=True,
                         text=True, timeout=600)
    signum = getattr(signal, signame)
    assert res.returncode == 128 + signum, res.stderr
    assert f"stopped ({signame})" in res.stderr and "--resume" in res.stderr and "Traceback" not in res.stderr
    # The writer also flushes every 10 s: on a loaded machine the first answers may already
    # lie in an earlier part. Part names start with the time, so their order is the writing order.
    parts = sorted(Path(str(out) + ".parts").glob("part-*.parquet"))
    saved = [i for part in parts for i in pq.read_table(part).column("id").to_pylist()]
    assert saved == ["s0", "s1", "s2"]
    relay(*args, "--resume")
    assert [r["id"] for r in _jsonl(out)] == [f"s{i}" for i in range(len(QUESTIONS))]


@pytest.mark.slow
def test_relay_runs_beside_the_newest_transformers_and_hugging_faces_kernels(tmp_path):
    """relay claims no generic import name (its kernels and models are relaycli.kernels and
    relaycli.models): in an environment that adds the newest transformers and Hugging Face's
    `kernels` distribution, whose import name is `kernels`, the main job still runs."""
    import site
    import sysconfig
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    # this environment's packages (torch, relay, the default model) behind the new one's own
    child_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    parents = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    Path(child_site, "relay_parent.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in dict.fromkeys(parents)) + "\n")
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "transformers", "kernels"],
                         capture_output=True, text=True, timeout=900)
    if pip.returncode != 0:
        if "No matching distribution" in pip.stderr or "Could not find" in pip.stderr or "connection" in pip.stderr.lower():
            pytest.skip(f"the package index is out of reach: {pip.stderr.strip().splitlines()[-1]}")
        raise AssertionError(pip.stderr[-3000:])
    probe = subprocess.run([str(python), "-c", "import kernels, transformers; print(kernels.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert probe.returncode == 0 and "relaycli" not in probe.stdout, probe.stderr[-2000:]
    (tmp_path / "sys.txt").write_text(SYSTEM)
    (tmp_path / "r.jsonl").write_text(json.dumps({"prompt": "Where are the screws?", "max_tokens": 4}) + "\n")
    cli = [str(python), "-c", "from relaycli.cli import entry; entry()"]
    for args in (["compile-prompt", "sys.txt", "--quiet"],
                 ["run", "--in", "r.jsonl", "--out", "o.parquet", "--prompt", "sys.relaykv", "--quiet"]):
        out = subprocess.run(cli + args, capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    rows = pq.read_table(tmp_path / "o.parquet").to_pylist()
    assert len(rows) == 1 and rows[0]["finish_reason"] != "error" and rows[0]["cached_tokens"] > 20


def test_several_prompts_compile_with_one_load_and_rows_pick_them_by_name(job, tmp_path):
    (tmp_path / "bolt.txt").write_text(SYSTEM)
    (tmp_path / "pirate.txt").write_text("You are a pirate. Answer every question in pirate speak, in one line.")
    relay("compile-prompt", tmp_path / "bolt.txt", tmp_path / "pirate.txt", "--quiet")
    refused = relay("compile-prompt", tmp_path / "bolt.txt", tmp_path / "pirate.txt", "--out", tmp_path / "x.relaykv",
                    check=False)
    assert refused.returncode == 2 and "--out names one artifact" in refused.stderr
    rows = [{"id": str(i), "prompt": q, "max_tokens": 4, "temperature": 0, "system_prompt": name}
            for i, (q, name) in enumerate(zip(QUESTIONS, ["bolt", "pirate"] * 4))]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = tmp_path / "s.json"
    relay("run", "--in", tmp_path / "r.jsonl", "--out", tmp_path / "o.parquet", "--prompt", tmp_path / "bolt.relaykv",
          "--prompt", tmp_path / "pirate.relaykv", "--stats-json", stats, "--quiet")
    out = pq.read_table(tmp_path / "o.parquet").to_pylist()
    assert len(out) == 8 and all(r["finish_reason"] != "error" for r in out)
    assert json.loads(stats.read_text())["stats"]["prefix_hits"] == 8


def test_every_refusal_is_one_relay_error_the_cli_prints_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from relaycli.artifact import ArtifactError
    from relaycli.cli import app
    from relaycli.compile import CompileError
    from relaycli.errors import ConfigError, RelayError
    from relaycli.io.reader import InputError
    from relaycli.io.writer import OutputError
    from relaycli.models.config import ModelConfigError
    from relaycli.models.tokenizer import TokenizerError
    from relaycli.models.weights import WeightError
    from relaycli.prompts import PromptError
    for cls in (ArtifactError, CompileError, ConfigError, InputError, OutputError, ModelConfigError, TokenizerError,
                WeightError, PromptError):
        assert issubclass(cls, RelayError), cls
    (tmp_path / "r.jsonl").write_text('{"prompt": "hi"}\n')
    for option, value, says in (("--max-batch", "0", "--max-batch must be at least 1"),
                                ("--temperature", "-1", "--temperature must be a number >= 0"),
                                ("--max-tokens", "0", "--max-tokens must be an integer >= 1")):
        result = CliRunner().invoke(app, ["run", "--in", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "o.jsonl"),
                                          option, value])
        assert result.exit_code == 2 and says in result.output, result.output
        assert result.output.count("\n") <= 2 and "Traceback" not in result.output

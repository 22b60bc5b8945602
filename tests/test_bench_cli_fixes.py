"""`relay bench` as a user meets it: the group lists its subcommands and takes no options of
its own, `show` prints every kind of result the subcommands write (and names the rest),
`jobs` refuses a machine without CUDA, `modules` prints tables, and `soak` keeps to
--minutes, moves every job on and leaves no folder behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from relaycli.cli import app

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
SUBCOMMANDS = ("e2e", "kernels", "volume", "soak", "show", "modules", "jobs")


def test_bench_alone_lists_its_subcommands_and_runs_nothing():
    res = CliRunner().invoke(app, ["bench"])
    assert "bench [OPTIONS] COMMAND" in res.output and all(f" {name} " in res.output for name in SUBCOMMANDS)
    assert "relay bench kernels" not in res.output  # no benchmark table: nothing ran


@pytest.mark.parametrize("option", [["--json", "grp.json"], ["--plot", "p.png"], ["--quiet"], ["--device", "cpu"]])
def test_options_before_the_subcommand_are_refused_not_ignored(tmp_path, option):
    given = [str(tmp_path / a) if a.endswith((".json", ".png")) else a for a in option]
    res = CliRunner().invoke(app, ["bench", *given, "kernels", "--model", "dummy:tiny", "--device", "cpu"])
    assert res.exit_code == 2 and f"No such option: {option[0]}" in res.output
    assert list(tmp_path.iterdir()) == []


def _result_files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", _result_files(), ids=lambda p: p.name)
def test_show_prints_each_relay_bench_result_in_docs_results_and_names_the_rest(path):
    data = json.loads(path.read_text())
    res = CliRunner().invoke(app, ["bench", "show", str(path)])
    if isinstance(data, list):  # relay bench jobs' jobs.json
        assert res.exit_code == 0, res.output
        assert "relay bench jobs: whole relay run jobs" in res.output
        assert all(row["job"] in res.output for row in data)
    elif isinstance(data, dict) and data.get("kind") == "e2e-through-run":
        assert res.exit_code == 0, res.output
        assert "relay bench e2e --through-run" in res.output and "host work per row" in res.output
    else:  # written by scripts/ (device_kernels.py, device_e2e.py) or by scripts since removed
        assert res.exit_code == 2
        line = " ".join(res.output.split())
        assert line.startswith(f"error: {path} is not a relay bench result") and "jobs.json of relay bench jobs" in line


def test_docs_results_hold_both_kinds_show_prints():
    saved = [json.loads(p.read_text()) for p in _result_files()]
    kinds = {"jobs" if isinstance(d, list) else d.get("kind") for d in saved}
    assert {"jobs", "e2e-through-run"} <= kinds  # the parametrized test above shows them


def test_show_jobs_names_each_jobs_speedup_over_its_no_relay_twin(tmp_path):
    rows = [{"job": "mixed-llama3", "rows": 2000, "errors": 0, "process_seconds": 28.06, "job_seconds": 16.72,
             "rows_per_second": 119.6, "decode_steps": 504, "graphed_decode_steps": 504},
            {"job": "mixed-llama3-no-relay", "rows": 2000, "errors": 0, "process_seconds": 41.37, "job_seconds": 28.9,
             "rows_per_second": 69.2, "decode_steps": 504, "graphed_decode_steps": 504},
            {"job": "examples-cold", "rows_per_second": 45.8},
            {"job": "examples-no-relay-cold", "rows_per_second": 54.5},
            {"job": "readme-main-job", "process_seconds": 14.97}]
    saved = tmp_path / "jobs.json"
    saved.write_text(json.dumps(rows, indent=1))
    res = CliRunner().invoke(app, ["bench", "show", str(saved), "--json", str(tmp_path / "again.json")])
    assert res.exit_code == 0, res.output
    line = {r["job"]: next(x for x in res.output.splitlines() if f" {r['job']} " in x) for r in rows}
    assert "119.6" in line["mixed-llama3"] and " 1.73 " in line["mixed-llama3"]  # 119.6 / 69.2 rows/s
    assert " 0.84 " in line["examples-cold"] and "14.97" in line["readme-main-job"]
    again = CliRunner().invoke(app, ["bench", "show", str(tmp_path / "again.json")])  # show's own --json reads back
    assert again.exit_code == 0 and line["mixed-llama3"] in again.output
    refused = CliRunner().invoke(app, ["bench", "show", str(saved), "--plot", str(tmp_path / "p.png")])
    assert refused.exit_code == 2 and "--plot draws e2e and kernels results" in refused.output
    assert not (tmp_path / "p.png").exists()


MODULES_REPORT = {
    "kind": "modules",
    "ttft": {"module_tokens": 2997, "prompt_tokens": 3061, "relay_cold_s": 0.912, "relay_warm_s": 0.0431,
             "full_prefill_s": 1.87, "speedup_warm": 43.4, "speedup_cold": 2.05, "threads": 2},
    "independent": {"pairs": 108, "answer_tokens": 1728, "agreement": 0.853, "first_token_agreement": 0.917,
                    "control_agreement": 1.0, "threads": 2},
}


def _modules_tables_in(output: str) -> None:
    assert "prompt modules: time to first token, 2,997 module tokens of 3,061" in output
    assert "43.40" in output and "0.043" in output and "85.3%" in output and "100.0%" in output
    assert '"kind"' not in output  # a table, not the JSON


def test_bench_modules_prints_tables_and_writes_the_same_json(monkeypatch, tmp_path):
    import relaycli.bench.modules as modules
    import relaycli.models.registry as registry
    monkeypatch.setattr(registry, "load_model", lambda *a, **k: object())
    monkeypatch.setattr(modules, "ttft", lambda loaded, tokens: dict(MODULES_REPORT["ttft"]))
    monkeypatch.setattr(modules, "independent_agreement",
                        lambda loaded, docs, answer: dict(MODULES_REPORT["independent"]))
    out = tmp_path / "modules.json"
    res = CliRunner().invoke(app, ["bench", "modules", "--json", str(out)])
    assert res.exit_code == 0, res.output
    _modules_tables_in(res.output)
    assert json.loads(out.read_text()) == MODULES_REPORT
    shown = CliRunner().invoke(app, ["bench", "show", str(out)])
    assert shown.exit_code == 0, shown.output
    _modules_tables_in(shown.output)


def test_bench_jobs_refuses_a_machine_without_cuda_before_any_work(monkeypatch, tmp_path):
    import torch

    import relaycli.bench.jobs as jobs

    def no_run(*args, **kwargs):
        raise AssertionError("relay bench jobs started a job on a machine without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(jobs, "relay", no_run)
    started = time.perf_counter()
    res = CliRunner().invoke(app, ["bench", "jobs", "examples", "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and time.perf_counter() - started < 5
    assert " ".join(res.output.split()).startswith("error: relay bench jobs needs a CUDA GPU")
    assert len(res.output.strip().splitlines()) <= 2  # one sentence (wrapped at most once by the console)
    assert not (tmp_path / "out").exists()


def test_a_short_soak_keeps_to_its_minutes_and_finishes_its_jobs(monkeypatch, tmp_path):
    """The reference run, then jobs of 24 rows stopped and resumed: relay takes seconds to
    start, longer than a third of the reference run, so a stop timed from a run's start
    would catch every run before its first answer."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "soak.json"
    minutes = 1.0
    started = time.perf_counter()
    res = CliRunner().invoke(app, ["bench", "soak", "--minutes", str(minutes), "--rows", "24", "--json", str(out)])
    took = time.perf_counter() - started
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert took < 60 * minutes + 10 and report["minutes"] < minutes + 5 / 60, (took, report)
    assert report["jobs"] >= 1 and report["rows_checked"] == 24 * report["jobs"], report  # each equal to the reference
    assert report["stops"] >= 1 and set(report["exit_statuses"]) <= {"0", "143", "-15", "-9"}, report
    assert "relay run stopped and resumed" in res.output
    assert list(scratch.iterdir()) == []  # the soak's folder is gone


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_soak_removes_its_folder_and_its_run(tmp_path, sig):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    # Python's own SIGINT handler first, as a terminal gives it: a shell without job control
    # (CI's, started in the background) starts its children with SIGINT ignored
    child = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); " \
            "from relaycli.cli import entry; entry()"
    proc = subprocess.Popen([sys.executable, "-c", child, "bench", "soak",
                             "--minutes", "2", "--rows", "40"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not any("reference.parquet" in cmd for cmd in _processes_naming(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)  # until the uninterrupted reference run is under way
    time.sleep(0.5)
    assert proc.poll() is None and any(tmp_path.glob("relay-soak-*"))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    assert f"stopped ({signal.Signals(sig).name}): the soak ended early" in err
    assert list(tmp_path.iterdir()) == []
    assert _processes_naming(tmp_path) == []  # the relay run in flight was stopped too


def _processes_naming(folder: Path) -> list[str]:
    """Command lines of live processes that name a path in folder."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(folder) in cmd:
            found.append(cmd)
    return found

"""`relay run --devices cpu,cpu`: two worker processes give the answers of one process,
also when a worker is killed mid-job (its rows go to the other) and when the parent is
killed with kill -9 (`--resume` finishes the job; the workers do not outlive it)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from relaycli.errors import ConfigError
from relaycli.io.requests import RequestDefaults
from relaycli.job import JobOptions, run_job
from relaycli.parallel.devices import check_devices, parse_devices
from relaycli.parallel.pool import WorkerError
from tests.helpers_faults import Child, run

N = 48
MODEL = ["--model", "dummy:tiny", "--max-batch", "2", "--quiet"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A prompt artifact and N rows, greedy and sampled, some with their own seed, one bad."""
    d = tmp_path_factory.mktemp("devices")
    (d / "sys.txt").write_text("You are a test assistant. Answer briefly.")
    rc, lines = run(["compile-prompt", d / "sys.txt", "--model", "dummy:tiny", "--device", "cpu", "--quiet"])
    assert rc == 0, lines
    with open(d / "in.jsonl", "w") as f:
        for i in range(N):
            row = {"id": f"r{i}", "prompt": f"tell me about {i}", "max_tokens": 12 + i % 5}
            row.update({"temperature": 0} if i % 3 == 0 else {"temperature": 0.9, "top_p": 0.95})
            if i % 7 == 0:
                row["seed"] = 1000 + i
            f.write(json.dumps(row) + "\n")
        f.write('{"id": "bad", "prompt": 7}\n')
    reference = d / "ref.parquet"
    run_job(_opts(d, reference, device="cpu"))
    return d, pq.read_table(reference).to_pylist()


def _opts(d: Path, out: Path, **kw) -> JobOptions:
    from relaycli.config import EngineConfig
    return JobOptions(input_path=d / "in.jsonl", output_path=out, prompt_paths=[d / "sys.relaykv"],
                      model="dummy:tiny", engine=EngineConfig(max_num_seqs=2), flush_rows=2,
                      defaults=RequestDefaults(max_tokens=16, seed_base=5), **kw)


def test_device_lists_are_checked_before_any_work():
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"] and parse_devices("cuda:0,cuda:1") == ["cuda:0", "cuda:1"]
    for bad, words in (("cuda", "name the GPU"), ("cuda:0,cuda:0", "twice"), ("gpu0", "not a device"),
                       ("cpu,", "not a device")):
        with pytest.raises(ConfigError, match=words):
            parse_devices(bad)
    with pytest.raises(ConfigError, match="--device and --devices"):
        JobOptions(input_path=Path("a.jsonl"), output_path=Path("b.jsonl"), device="cpu", devices=["cpu"])
    with pytest.raises(ConfigError, match="empty"):
        check_devices([])
    with pytest.raises(ConfigError, match="--worker-timeout must be a positive"):
        JobOptions(input_path=Path("a.jsonl"), output_path=Path("b.jsonl"), devices=["cpu"], worker_timeout=0)


def test_two_workers_answer_as_one_process(job, tmp_path):
    d, reference = job
    summary = run_job(_opts(d, tmp_path / "out.parquet", devices=["cpu", "cpu"]))
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == reference  # greedy and sampled rows alike
    assert reference[-1]["finish_reason"] == "error" and "'prompt' must be a string" in reference[-1]["error"]
    workers = summary.workers
    assert [w["device"] for w in workers] == ["cpu", "cpu"] and all(w["state"] == "done" for w in workers)
    assert sum(w["rows"] for w in workers) == N and all(w["rows"] > 0 for w in workers)  # the bad row: the parent's
    assert summary.stats.rows == N + 1 and summary.stats.prefix_hits == N
    # the job's quantiles come from every worker's values (few enough here to be exact)
    st = summary.stats
    assert st.ttft.count == N and st.decode_step.count == st.decode_steps == sum(
        w["stats"]["decode_steps"] for w in workers)
    medians = sorted(w["stats"]["decode_step_p50_seconds"] for w in workers)
    assert medians[0] <= st.as_dict()["decode_step_p50_seconds"] <= medians[1]


def test_a_worker_killed_mid_job_leaves_every_row_answered_once(job, tmp_path):
    """SIGKILL one worker once it has answered 3 rows: its unanswered rows go to the other."""
    d, reference = job
    killed = []

    def kill_one(reports):
        if not killed and reports[1]["rows"] >= 3:
            killed.append(reports[1]["pid"])
            os.kill(reports[1]["pid"], signal.SIGKILL)

    summary = run_job(_opts(d, tmp_path / "out.parquet", devices=["cpu", "cpu"]), on_workers=kill_one)
    assert killed and summary.workers[1]["state"] == "stopped"
    assert summary.workers[1]["cause"] == "killed by SIGKILL" and summary.workers[0]["state"] == "done"
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == reference
    assert summary.workers[0]["rows"] + summary.workers[1]["rows"] == N


def test_a_hung_worker_is_stopped_and_its_counters_kept(job, tmp_path):
    """SIGSTOP one worker once it has answered 3 rows (a process that never answers again):
    after --worker-timeout it is killed, its rows go to the other, and the job's counters keep
    the engine steps it made before it hung."""
    d, reference = job
    stopped, seen = [], {}

    def freeze_one(reports):
        if not stopped and reports[1]["rows"] >= 3 and reports[1]["stats"] is not None:
            stopped.append(reports[1]["pid"])
            seen.update(reports[1]["stats"])
            os.kill(reports[1]["pid"], signal.SIGSTOP)

    t0 = time.monotonic()
    summary = run_job(_opts(d, tmp_path / "out.parquet", devices=["cpu", "cpu"], worker_timeout=10.0),
                      on_workers=freeze_one)
    assert stopped and time.monotonic() - t0 < 120
    hung, other = summary.workers[1], summary.workers[0]
    assert hung["state"] == "stopped" and "made no progress for 10 s (hung" in hung["cause"], hung
    assert other["state"] == "done" and hung["rows"] + other["rows"] == N
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == reference
    assert not Path(f"/proc/{stopped[0]}").exists() or "Z" in Path(f"/proc/{stopped[0]}/stat").read_text().split()[2]
    assert hung["stats"]["decode_steps"] >= seen["decode_steps"] > 0
    assert summary.stats.decode_steps == other["stats"]["decode_steps"] + hung["stats"]["decode_steps"]


def test_a_worker_that_never_loads_stops_the_job_before_any_row(job, tmp_path):
    """A worker stopped (SIGSTOP) while it loads sends nothing, not even `loading`: after
    --worker-timeout the job stops with one sentence naming the fix instead of waiting for
    it forever, and the worker is gone. A worker that loads for longer than that keeps
    sending `loading`."""
    from relaycli.parallel.job import in_flight_window, worker_spec
    from relaycli.parallel.pool import WorkerPool
    d, _ = job
    opts = _opts(d, tmp_path / "out.parquet", devices=["cpu", "cpu"], worker_timeout=3.0)
    pool = WorkerPool(opts.devices, worker_spec(opts), in_flight_window(opts), opts.worker_timeout)
    stuck = pool.workers[1].process
    try:
        os.kill(stuck.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"^the worker on cpu sent nothing for 3 s while loading the model "
                                              r"\(hung\); check the device and run the job again$"):
            pool.wait_ready()
        assert time.monotonic() - t0 < 60
    finally:
        pool.close()
    assert not stuck.is_alive()


def test_every_worker_killed_stops_the_job_and_resume_finishes_it(job, tmp_path):
    """Both workers killed: the job stops with its answers saved; rows in flight on both are
    error rows naming the cause; a --resume (here without --devices) answers the rest."""
    d, reference = job
    out = tmp_path / "out.parquet"

    def kill_both(reports):
        if reports[0]["rows"] >= 3 and reports[0]["state"] != "stopped":
            os.kill(reports[0]["pid"], signal.SIGKILL)
        elif reports[0]["state"] == "stopped" and reports[1]["rows"] >= 6 and reports[1]["state"] != "stopped":
            os.kill(reports[1]["pid"], signal.SIGKILL)

    with pytest.raises(WorkerError, match="every worker stopped .*killed by SIGKILL.*--resume"):
        run_job(_opts(d, out, devices=["cpu", "cpu"]), on_workers=kill_both)
    run_job(_opts(d, out, device="cpu", resume=True))
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [r["id"] for r in reference]
    lost = [r for r in rows if r["finish_reason"] == "error" and r["id"] != "bad"]
    assert all("two workers stopped while answering it" in r["error"] and "SIGKILL" in r["error"] for r in lost)
    assert [r for r in rows if r not in lost] == [r for r, s in zip(reference, rows) if s not in lost]


def _workers_of(pid: int) -> list[int]:
    """The spawned worker processes whose parent is pid."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
                found.append(int(entry))
    return found


def test_kill_9_of_the_parent_then_resume_gives_every_row_once(job, tmp_path):
    d, reference = job
    out = tmp_path / "out.parquet"
    args = ["run", "--in", d / "in.jsonl", "--out", out, "--prompt", d / "sys.relaykv", *MODEL, "--flush-rows", "2",
            "--max-tokens", "16", "--seed", "5", "--devices", "cpu,cpu"]
    child = Child(args, RELAY_TEST_PAUSE_PARTS=f"{out}.parts", RELAY_TEST_GO=str(tmp_path / "never"))
    assert child.wait_for("PAUSED"), child.finish()
    workers = _workers_of(child.proc.pid)
    assert len(workers) == 2
    child.kill()
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]
              for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert time.monotonic() < deadline, "a worker outlived its parent"
    saved = {r["row_index"] for r in pq.read_table(next(Path(f"{out}.parts").glob("part-*.parquet"))).to_pylist()}
    assert 0 < len(saved) < N
    rc, lines = run([*args, "--resume"])
    assert rc == 0, lines
    assert pq.read_table(out).to_pylist() == reference

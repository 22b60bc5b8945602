"""kill -9 anywhere in `relay run`, then `--resume`: every row exactly once, as uninterrupted.

One job is killed again and again: at random moments once parts are being saved, and at
each step of a write (a part's temp file written but not renamed, a part just renamed,
the final OUT's temp file, OUT renamed with its parts not yet removed). The child waits
at the chosen step (helpers_faults) so the kill lands there; each kill is checked to
have landed where meant. A last `--resume` must finish the job with the answers of an
uninterrupted run.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pyarrow.parquet as pq

from tests.helpers_faults import Child, run, saved_rows

N = 60
FLAGS = ["--model", "dummy:tiny", "--max-batch", "2", "--flush-rows", "2", "--quiet"]


def _kill_at_random(args: list, parts: Path, rng: random.Random) -> None:
    """Kill once this run has saved 1 to 3 more parts, after a random pause (0-0.3 s):
    mid-step, mid-write or between writes, wherever that lands."""
    before = len(list(parts.glob("part-*.parquet"))) if parts.is_dir() else 0
    want = before + rng.randint(1, 3)
    child = Child(args)
    deadline = time.monotonic() + 120
    while child.proc.poll() is None and time.monotonic() < deadline:
        if parts.is_dir() and len(list(parts.glob("part-*.parquet"))) >= want:
            time.sleep(rng.uniform(0, 0.3))
            break
        time.sleep(0.005)
    assert child.proc.poll() is None, "the job ended before the kill: the plan gives it too few rows"
    child.kill()


def _kill_at(args: list, phase: str, nth: int) -> None:
    child = Child(args, RELAY_TEST_STOP_AT=f"{phase}:{nth}")
    assert child.wait_for(f"STOPPED {phase}"), f"the job never reached {phase}: {child.finish()}"
    child.kill()


def test_kill_9_anywhere_then_resume_gives_every_row_once(tmp_path):
    rng = random.Random()
    src, ref, out = tmp_path / "in.jsonl", tmp_path / "ref.parquet", tmp_path / "out" / "out.parquet"
    out.parent.mkdir()
    src.write_text("".join(json.dumps({"id": f"k{i}", "prompt": f"tell me about {i}", "max_tokens": 24,
                                       "temperature": 0}) + "\n" for i in range(N)))
    rc, lines = run(["run", "--in", src, "--out", ref, *FLAGS])
    assert rc == 0, lines
    reference = pq.read_table(ref).to_pylist()
    by_id = {r["id"]: r for r in reference}
    args = ["run", "--in", src, "--out", out, *FLAGS, "--resume"]
    parts = Path(f"{out}.parts")

    # Parts: 30 in all; the kills before the final merge save at most about 18 of them.
    _kill_at(args, "part-tmp", rng.randint(1, 3))
    assert list(parts.glob(".tmp-part-*")), "killed mid part write: its temp file is left"
    _kill_at_random(args, parts, rng)
    _kill_at(args, "part-renamed", rng.randint(1, 3))
    _kill_at_random(args, parts, rng)
    saved = saved_rows(out)
    assert len({r["row_index"] for r in saved}) == len(saved) < N  # no row saved twice, rows left to do
    assert all({k: r[k] for k in by_id[r["id"]]} == by_id[r["id"]] for r in saved)

    _kill_at(args, "out-tmp", 1)  # this run answers the rest, then dies writing OUT
    assert not out.exists() and (out.parent / f".tmp-{out.name}").exists()
    assert sorted(r["row_index"] for r in saved_rows(out)) == list(range(N))
    _kill_at(args, "out-renamed", 1)  # OUT in place, its parts still there
    assert out.exists() and parts.is_dir()

    rc, lines = run(args)
    assert rc == 0, lines
    assert pq.read_table(out).to_pylist() == reference
    assert not parts.exists() and sorted(p.name for p in out.parent.iterdir()) == [out.name]

"""kill -9 anywhere in `relay run`, then `--resume`: every row exactly once, as uninterrupted.

One job is killed 20 times, spread over the whole job. 18 kills come while its parts are
saved, in six rounds of three: at a step of a part's write (its temp file written but not
renamed; the part just renamed) and at a random moment of a run that is saving parts
(mid-step, mid-write or between writes). The last two come while OUT is written: its temp
file written, then OUT renamed with its parts not yet removed. The child waits at the
chosen step (helpers_faults) so the kill lands there; each kill is checked to have landed
where meant, by the parts it leaves. A last `--resume` must finish the job with the
answers of an uninterrupted run.

The plan comes from a seeded random.Random, so every run of the test makes the same
choices, and it bounds what each kill lets its run save: the 18 kills save at most 24
parts of at most 2 rows, whatever the machine's speed, so rows are always left for the run
that writes OUT.
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
SEED = 20260512
ROUNDS = 6  # each: a kill mid part write, one at a random moment, one just after a part's rename
RANDOM_PARTS = 2  # a run killed at a random moment saves 1 to this many parts
RANDOM_PAUSE = 0.1  # seconds: the most a random kill waits once its run has saved a part


def _parts(parts: Path) -> int:
    return len(list(parts.glob("part-*.parquet"))) if parts.is_dir() else 0


def _kill_at_random(args: list, parts: Path, rng: random.Random) -> None:
    """Kill once this run has saved a part, after a random pause: mid-step, mid-write or
    between writes, wherever that lands. The run stops (to be killed) just after saving
    its RANDOM_PARTS-th part if the pause is not over by then, so a fast machine cannot
    save more within the pause."""
    want = _parts(parts) + 1
    pause = rng.uniform(0, RANDOM_PAUSE)
    child = Child(args, RELAY_TEST_STOP_AT=f"part-renamed:{RANDOM_PARTS}")
    deadline = time.monotonic() + 300
    while child.proc.poll() is None and time.monotonic() < deadline:
        if _parts(parts) >= want:
            time.sleep(pause)
            break
        time.sleep(0.005)
    assert child.proc.poll() is None, "the job ended before the kill: the plan gives it too few rows"
    child.kill()


def _kill_at(args: list, phase: str, nth: int) -> None:
    child = Child(args, RELAY_TEST_STOP_AT=f"{phase}:{nth}")
    assert child.wait_for(f"STOPPED {phase}"), f"the job never reached {phase}: {child.finish()}"
    child.kill()


def _check_saved(out: Path, by_id: dict) -> None:
    """The saved rows: none twice, each the uninterrupted run's answer, some still to do."""
    saved = saved_rows(out)
    assert len({r["row_index"] for r in saved}) == len(saved) < N  # no row saved twice, rows left to do
    assert all({k: r[k] for k in by_id[r["id"]]} == by_id[r["id"]] for r in saved)


def test_kill_9_anywhere_then_resume_gives_every_row_once(tmp_path):
    rng = random.Random(SEED)
    src, ref, out = tmp_path / "in.jsonl", tmp_path / "ref.parquet", tmp_path / "out" / "out.parquet"
    out.parent.mkdir()
    src.write_text("".join(json.dumps({"id": f"k{i}", "prompt": f"tell me about {i}", "max_tokens": 24,
                                       "temperature": 0}) + "\n" for i in range(N)))
    rc, lines = run(["run", "--in", src, "--out", ref, *FLAGS])
    assert rc == 0, lines
    reference = pq.read_table(ref).to_pylist()
    assert len(reference) == N
    by_id = {r["id"]: r for r in reference}
    args = ["run", "--in", src, "--out", out, *FLAGS, "--resume"]
    parts = Path(f"{out}.parts")

    # A round saves 0-1 parts (mid write), 1-RANDOM_PARTS (random) and 1 (renamed), each of
    # at most 2 rows (--flush-rows 2): at most 48 rows in all, so the rounds never finish the job.
    assert 2 * ROUNDS * (1 + RANDOM_PARTS + 1) < N
    for _ in range(ROUNDS):
        before, nth = _parts(parts), rng.randint(1, 2)
        _kill_at(args, "part-tmp", nth)  # the nth part's temp file is written, not renamed
        assert list(parts.glob(".tmp-part-*")), "killed mid part write: its temp file is left"
        assert _parts(parts) == before + nth - 1, "the kill landed at another part"

        before = _parts(parts)
        _kill_at_random(args, parts, rng)
        assert before + 1 <= _parts(parts) <= before + RANDOM_PARTS, "the random kill landed outside its window"
        _check_saved(out, by_id)

        before = _parts(parts)
        _kill_at(args, "part-renamed", 1)  # the run's first part is in place, nothing after it
        assert not list(parts.glob(".tmp-part-*")) and _parts(parts) == before + 1
        _check_saved(out, by_id)

    _kill_at(args, "out-tmp", 1)  # this run answers the rest, then dies writing OUT
    assert not out.exists() and (out.parent / f".tmp-{out.name}").exists()
    assert sorted(r["row_index"] for r in saved_rows(out)) == list(range(N))
    _kill_at(args, "out-renamed", 1)  # OUT in place, its parts still there
    assert out.exists() and parts.is_dir()

    rc, lines = run(args)
    assert rc == 0, lines
    assert pq.read_table(out).to_pylist() == reference
    assert not parts.exists() and sorted(p.name for p in out.parent.iterdir()) == [out.name]

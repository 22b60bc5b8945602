"""`relay run` when the disk or the input fails mid-job: one line, exit status 2, the answers
saved so far kept, and `--resume` (the fault gone) finishing with every row once.

Each fault is the operating system's: a file-size limit (what a full disk looks like to a
write: RLIMIT_FSIZE, EFBIG), a folder made read-only or moved away, an input file cut
short. The child pauses after its first saved part (helpers_faults) so that the fault
lands mid-job, then goes on and meets it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from relaycli.io.reader import InputError, open_requests
from tests.helpers_faults import Child, assert_one_line_error, run, saved_rows

N = 40
ROWS = [{"id": f"r{i}", "prompt": f"question number {i}", "max_tokens": 3, "temperature": 0} for i in range(N)]
FLAGS = ["--model", "dummy:tiny", "--max-batch", "2", "--flush-rows", "2", "--quiet"]


def _write_rows(path: Path, pad: int = 0) -> None:
    # pad: JSON whitespace inside each line, to make a file larger than the reader's buffer
    path.write_text("".join(json.dumps(r)[:-1] + " " * pad + "}\n" for r in ROWS))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The answers of an uninterrupted run (greedy: every run must give exactly these)."""
    d = tmp_path_factory.mktemp("reference")
    _write_rows(d / "in.jsonl")
    rc, lines = run(["run", "--in", d / "in.jsonl", "--out", d / "out.parquet", *FLAGS])
    assert rc == 0, lines
    rows = pq.read_table(d / "out.parquet").to_pylist()
    assert [r["id"] for r in rows] == [r["id"] for r in ROWS] and all(r["error"] is None for r in rows)
    return rows


def _job(tmp_path: Path, out_name: str = "out.parquet", pad: int = 0) -> tuple[Path, Path, list]:
    (tmp_path / "outdir").mkdir()
    src, out = tmp_path / "in.jsonl", tmp_path / "outdir" / out_name
    _write_rows(src, pad)
    return src, out, ["run", "--in", src, "--out", out, *FLAGS]


def _paused(args: list, out: Path, tmp_path: Path, wrap: list[str] = ()) -> Child:
    """The job, held after its first saved part until _go(tmp_path)."""
    child = Child(args, wrap, RELAY_TEST_PAUSE_PARTS=f"{out}.parts", RELAY_TEST_GO=str(tmp_path / "go"))
    assert child.wait_for("PAUSED"), f"the job ended before its first part: {child.finish()}"
    return child


def _go(tmp_path: Path) -> None:
    (tmp_path / "go").touch()


def _read_out(out: Path) -> list[dict]:
    if out.suffix == ".jsonl":
        return [json.loads(line) for line in out.read_text().splitlines()]
    return pq.read_table(out).to_pylist()


def _check_resume(args: list, out: Path, reference: list[dict], saved: list[dict]) -> None:
    """Without the fault, --resume finishes the job: every row once, the uninterrupted
    run's answers; the saved answers were kept and are not computed again."""
    assert saved, "no answer was saved before the fault"
    by_id = {r["id"]: r for r in reference}
    for row in saved:
        assert {k: row[k] for k in by_id[row["id"]]} == by_id[row["id"]]
    stats = out.parent.parent / "stats.json"
    rc, lines = run([*args, "--resume", "--stats-json", stats])
    assert rc == 0, lines
    assert _read_out(out) == reference
    assert json.loads(stats.read_text())["skipped_rows"] == len({r["id"] for r in saved})
    assert not Path(f"{out}.parts").exists()


def test_a_disk_that_fills_during_a_part_write(reference, tmp_path):
    src, out, args = _job(tmp_path)
    child = _paused(args, out, tmp_path)
    resource.prlimit(child.proc.pid, resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))  # parts are larger
    _go(tmp_path)
    rc, lines = child.finish()
    assert_one_line_error(rc, lines, f"cannot write {out}.parts/part-", "(File too large)", "--resume")
    _check_resume(args, out, reference, saved_rows(out))


def test_a_disk_that_fills_during_the_final_merge(reference, tmp_path):
    # Each part (2 rows) fits under 3,500 bytes; the JSONL OUT of all 40 rows does not.
    src, out, args = _job(tmp_path, "out.jsonl")
    rc, lines = run(args, RELAY_TEST_FSIZE="3500")
    assert_one_line_error(rc, lines, f"cannot write {out} (File too large)", "--resume")
    assert not out.exists() and not list(out.parent.glob(".tmp-*"))
    saved = saved_rows(out)
    assert sorted(r["row_index"] for r in saved) == list(range(N))  # every answer is saved in its parts
    _check_resume(args, out, reference, saved)


def _without_override() -> list[str]:
    """Root writes into a read-only folder anyway, unless it runs without CAP_DAC_OVERRIDE."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("as root a read-only folder needs setpriv to drop CAP_DAC_OVERRIDE")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]


def test_an_output_folder_made_read_only_mid_job(reference, tmp_path):
    src, out, args = _job(tmp_path)
    parts = Path(f"{out}.parts")
    child = _paused(args, out, tmp_path, wrap=_without_override())
    parts.chmod(0o555)
    try:
        _go(tmp_path)
        rc, lines = child.finish()
    finally:
        parts.chmod(0o755)
    assert_one_line_error(rc, lines, f"cannot write {parts}/part-", "(Permission denied)",
                          f"make {parts} writable", "--resume")
    _check_resume(args, out, reference, saved_rows(out))


def test_an_output_folder_moved_away_mid_job(reference, tmp_path):
    src, out, args = _job(tmp_path)
    child = _paused(args, out, tmp_path)
    moved = tmp_path / "moved"
    out.parent.rename(moved)
    _go(tmp_path)
    rc, lines = child.finish()
    assert_one_line_error(rc, lines, f"{out}.parts, where this job saves its answers, was removed or moved",
                          "--resume")
    moved.rename(out.parent)  # put back: the answers saved in it count
    _check_resume(args, out, reference, saved_rows(out))


def test_an_input_cut_short_mid_job(reference, tmp_path):
    # Rows padded to 200 kB: when the first part is saved the job has read at most about 21
    # rows (those in the engine and the prefetch queue at --max-batch 2) and its reader's
    # 1 MiB buffer 5 more, so the cut (inside row 30) is met while the job runs.
    src, out, args = _job(tmp_path, pad=200_000)
    whole = src.read_bytes()
    child = _paused(args, out, tmp_path)
    with open(src, "r+b") as f:
        f.truncate(whole.index(b'"r30"'))
    _go(tmp_path)
    rc, lines = child.finish()
    assert_one_line_error(rc, lines, f"the input file {src} changed while the job ran", "--resume")
    saved = saved_rows(out)
    assert saved and all(r["row_index"] < 30 for r in saved)
    # The cut file is not the job's input: refused, in one sentence saying so.
    rc, lines = run([*args, "--resume"])
    assert_one_line_error(rc, lines, "the input file changed since", "put the original input back to resume")
    src.write_bytes(whole)
    _check_resume(args, out, reference, saved)


def test_the_reader_refuses_a_file_replaced_or_cut_after_it_was_opened(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_rows(src, pad=200_000)
    whole = src.read_bytes()
    source = open_requests(src)
    other = tmp_path / "other.jsonl"
    other.write_bytes(whole)
    os.replace(other, src)  # the same bytes, but another file
    with pytest.raises(InputError, match="changed while the job ran"):
        next(iter(source))
    source = open_requests(src)
    rows = iter(source)
    first = [next(rows) for _ in range(3)]
    with open(src, "r+b") as f:
        f.truncate(whole.index(b'"r20"') + 10)  # inside row 20, past the buffer's first fill
    seen = []
    with pytest.raises(InputError, match="changed while the job ran"):
        for row in rows:
            seen.append(row)
    assert [r[1]["id"] for r in first + seen] == [f"r{i}" for i in range(20)]  # whole rows only, none cut
    assert all(r[2] is None for r in first + seen)


def test_a_parquet_input_cut_short_is_a_changed_input_not_damaged_row_groups(tmp_path):
    import pyarrow as pa
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), src, row_group_size=4)
    source = open_requests(src)
    rows = iter(source)
    assert next(rows)[1]["id"] == "r0"
    with open(src, "r+b") as f:
        f.truncate(src.stat().st_size // 2)
    with pytest.raises(InputError, match="changed while the job ran"):
        list(rows)  # rows 1-3 were read with their group; the next group meets the cut

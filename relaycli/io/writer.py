"""Crash-safe result writer: atomic parts while the job runs, one ordered file at the end.

Results arrive out of order. They are buffered and written as *parts* in `OUT.parts/`:
each a Parquet file sorted by row_index, written to a temp name, fsynced, renamed.
A part therefore either exists whole or not at all, so after a crash the parts are
exactly the finished rows (`--resume` skips them). `finalize` merges the parts in
row order (a streaming k-way merge), checks each row appears exactly once, writes
OUT atomically and removes the parts.

A job is tied to its output by a job record (what the answers depend on: the input's
bytes, the model, the artifacts, the defaults), kept as `job.json` in the parts folder
and in a finished Parquet OUT's metadata, so that `--resume` refuses to mix the answers
of two different jobs.

A write that fails (a full disk, a file-size limit, a folder made read-only or removed)
is an `OutputError` naming the path, the cause and the fix (failures.py); the parts
already saved stay, and `--resume` answers the rest.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from relaycli.io.failures import RESUME, OutputError, writing
from relaycli.io.outfile import JOB_META_KEY, another_job, complete_rows, job_record_of, openai_line
from relaycli.io.parts import (OUTPUT_COLUMNS, OUTPUT_SCHEMA, PART_SCHEMA, TMP, merge_parts,  # noqa: F401
                               output_row, part_row_indices, rows_table, write_atomically, write_json,
                               write_parquet)
from relaycli.io.requests import ResultRow
from relaycli.io.rowset import RowSet

__all__ = ["OUTPUT_COLUMNS", "OUTPUT_SCHEMA", "OutputError", "ResultWriter", "check_writable", "output_format",
           "same_file"]

_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
_FAN_IN = 64  # parts merged at once: bounds open files and the memory of the merge
JOB_FILE = "job.json"  # the job record, in the parts folder


def check_writable(path: Path, what: str = "output") -> None:
    """Fail before any work (model loading, compute) if a file could never be saved at
    path: its folder must exist and take a new file, and path must not be a folder."""
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"the {what} folder {parent} does not exist; create it first")
    if path.is_dir():
        raise OutputError(f"the {what} path {path} is a folder; give a file name")
    try:
        fd, probe = tempfile.mkstemp(prefix=TMP + "probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"cannot write to the {what} folder {parent} ({e.strerror})") from None


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file: the same inode where both exist (symlinks, hard
    links), else the same resolved path (a file that a run would create)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def output_format(path: str | Path, fmt: str | None = None) -> str:
    if fmt is not None:
        if fmt.lower() not in ("parquet", "jsonl"):
            raise OutputError(f"unknown output format {fmt!r}; use parquet or jsonl")
        return fmt.lower()
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise OutputError(f"cannot tell the output format of {path} from its extension; name it .parquet or .jsonl")
    return _SUFFIXES[suffix]


class ResultWriter:
    """Buffer results, write them as atomic parts, merge them into OUT at finalize."""

    def __init__(self, out_path: str | Path, fmt: str | None = None, resume: bool = False,
                 openai_output: bool = False, flush_rows: int = 256, flush_seconds: float = 10.0,
                 model_name: str = "relay") -> None:
        self.out_path = Path(out_path)
        self.fmt = output_format(self.out_path, fmt)
        self.openai_output = openai_output and self.fmt == "jsonl"  # OpenAI lines exist only as JSONL
        if not isinstance(flush_rows, int) or flush_rows < 1:
            raise OutputError(f"--flush-rows must be an integer >= 1, got {flush_rows!r}")
        if not flush_seconds > 0:
            raise ValueError(f"flush_seconds must be a number > 0, got {flush_seconds!r}")
        self.flush_rows, self.flush_seconds, self.model_name = flush_rows, flush_seconds, model_name
        self.parts_dir = self.out_path.with_name(self.out_path.name + ".parts")
        self.dropped_parts: list[Path] = []  # unreadable parts removed on resume (their rows rerun)
        self._complete = False  # resumed, and a previous run already finished OUT
        self._complete_checked = False
        self.error_rows = 0  # error rows of OUT, once it is finished or checked
        self.job: dict | None = None
        self._buffer: list[ResultRow] = []
        self._done = RowSet()  # rows with an answer, saved or buffered: a bit each
        self._parts_made = False  # the parts folder exists (made here, or found on resume)
        self._seq = 0
        self._last_flush = time.monotonic()
        self._finalized = False
        self._check_writable()
        self._lock_fd: int | None = self._lock()
        try:
            if not resume:
                for p in (self.out_path, self.parts_dir):
                    if p.exists():
                        raise OutputError(f"{p} already exists; pass --resume to continue that job or remove it")
            else:
                self._recover()
        except BaseException:
            self._unlock(remove=True)
            raise

    def _check_writable(self) -> None:
        check_writable(self.out_path)

    def _recover(self) -> None:
        with writing(self.parts_dir):
            self._recover_parts()

    def _recover_parts(self) -> None:
        for leftover in self.out_path.parent.glob(f"{TMP}{self.out_path.name}"):
            leftover.unlink()  # an OUT that a crash stopped mid-write
        if self.out_path.exists():
            self._complete = True
            return
        if not self.parts_dir.is_dir():
            return
        self._parts_made = True
        for path in sorted(self.parts_dir.iterdir()):
            if path.name.startswith(TMP):
                path.unlink()  # never renamed into place, so never counted as done
                continue
            if path.suffix != ".parquet":
                continue
            indices = part_row_indices(path)
            if indices is None:
                path.unlink()  # only disk corruption gets here; its rows are simply computed again
                self.dropped_parts.append(path)
                continue
            self._done.update(indices)

    @property
    def already_complete(self) -> bool:
        """A resumed job whose OUT exists: there is nothing left to do."""
        return self._complete

    def done_row_indices(self) -> RowSet:
        """The rows already answered (a copy): a bitmap, a bit a row."""
        return self._done.copy()

    def bind_job(self, job: dict, num_rows: int, row_ids: Iterator[str]) -> None:
        """Tie the output to one job before any row is computed. A resumed run must be the
        job that wrote what is there: same record, and for a finished OUT the same rows
        (row_ids: the input's ids, in order; read only for a finished OUT)."""
        job = json.loads(json.dumps(job, sort_keys=True))  # compared as it is stored
        self.job = job
        if self._complete:
            self._check_complete(job, num_rows, row_ids)
            return
        record = self.parts_dir / JOB_FILE
        if record.exists():
            try:
                stored = json.loads(record.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                stored = {}
            if not isinstance(stored, dict):
                stored = {}
            if job != stored:
                raise another_job(f"{self.parts_dir} holds answers", job, stored,
                                  "rerun that job as it was, or remove the folder",
                                  "remove the folder to start over")
        elif self._done:
            raise OutputError(f"{self.parts_dir} holds answers but no job record (an older relay wrote it); "
                              "remove the folder and run the job again")

    def _check_complete(self, job: dict | None, num_rows: int, row_ids: Iterator[str] | None) -> None:
        """OUT must hold num_rows rows (row_ids, when given, in order) and, where it keeps a
        job record, this job's; counts its error rows."""
        stored = job_record_of(self.out_path, self.fmt) if job is not None else None
        if stored is not None and stored != job:
            raise another_job(f"{self.out_path} holds the answers", job, stored, "remove it or choose another --out",
                              "remove it or choose another --out")
        count, errors, wanted = 0, 0, None if row_ids is None else iter(row_ids)
        for row_id, is_error in complete_rows(self.out_path, self.fmt):
            if count >= num_rows or (wanted is not None and next(wanted, None) != row_id):
                raise OutputError(f"row {count} of {self.out_path} (id {row_id!r}) is not row {count} of the "
                                  "input; it belongs to another job: remove it or choose another --out")
            count, errors = count + 1, errors + is_error
        if count != num_rows:
            raise OutputError(f"{self.out_path} holds {count} rows but the input has {num_rows}: it was cut short "
                              "or belongs to another job; remove it and run the job again")
        self.error_rows, self._complete_checked = errors, True

    def warm_up(self) -> None:
        """Build an empty part: pyarrow's first table imports what it loads lazily (pandas,
        where installed: about 0.4 s holding the interpreter lock). The job calls this on a
        thread while the model loads, so that the first flush, on the writer's thread in
        the middle of decoding, does not take the lock from the engine for that long."""
        rows_table([])

    def write(self, result: ResultRow) -> None:
        if self._finalized:
            raise RuntimeError("write after finalize")
        if not isinstance(result, ResultRow):
            raise TypeError(f"write takes a ResultRow, got {type(result).__name__}")
        if result.row_index in self._done:
            raise ValueError(f"row {result.row_index} already has a result")
        self._done.add(result.row_index)
        self._buffer.append(result)
        if len(self._buffer) >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the buffered results as one atomic part; after this they survive a crash."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        rows = sorted((vars(r) for r in self._buffer), key=lambda r: r["row_index"])
        table = rows_table(rows)
        if self._parts_made and not self.parts_dir.is_dir():
            raise OutputError(f"{self.parts_dir}, where this job saves its answers, was removed or moved while the "
                              f"job ran; put it back or choose another --out, {RESUME}")
        with writing(self.parts_dir):
            self.parts_dir.mkdir(exist_ok=True)
        self._parts_made = True
        record = self.parts_dir / JOB_FILE
        if self.job is not None and not record.exists():
            with writing(record):
                write_json(record, self.job)  # before the first part, so no part is ever without it
        self._write_part(lambda f: pq.write_table(table, f))
        self._buffer.clear()

    def _write_part(self, write) -> Path:
        # time_ns + pid keeps names unique across resumed runs without reading the folder.
        self._seq += 1
        path = self.parts_dir / f"part-{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.parquet"
        with writing(path):
            write_atomically(path, write)
        return path

    def _parts(self) -> list[Path]:
        if not self.parts_dir.is_dir():
            return []
        return sorted(p for p in self.parts_dir.iterdir() if p.suffix == ".parquet" and not p.name.startswith(TMP))

    def _reduce(self, parts: list[Path]) -> list[Path]:
        """Merge rounds of _FAN_IN parts until one k-way merge can take them all."""
        while len(parts) > _FAN_IN:
            merged = []
            for i in range(0, len(parts), _FAN_IN):
                group = parts[i:i + _FAN_IN]
                # The merged part lands before its sources go: a crash between leaves
                # duplicates, which _merge and resume both collapse to one.
                merged.append(self._write_part(lambda f, g=group: write_parquet(f, merge_parts(g), PART_SCHEMA)))
                for p in group:
                    p.unlink()
            parts = merged
        return parts

    def _checked(self, rows: Iterator[dict], num_rows: int) -> Iterator[dict]:
        expected = 0
        for row in rows:
            i = row["row_index"]
            if i >= num_rows:
                raise OutputError(f"{self.parts_dir} holds a result for row {i} but the input has "
                                  f"{num_rows} rows; it belongs to another job: remove it")
            if i != expected:
                raise OutputError(f"row {expected} has no result; run the job again with --resume to compute it")
            expected += 1
            yield row
        if expected != num_rows:
            raise OutputError(f"row {expected} has no result; run the job again with --resume to compute it")

    def finalize(self, num_rows: int) -> None:
        """Merge all parts into OUT in row order, atomically; every row exactly once or OutputError."""
        if self._complete:
            if not self._complete_checked:
                self._check_complete(None, num_rows, None)
        else:
            self.flush()
            with writing(self.out_path):  # a part that cannot be read back is an OutputError of its own
                rows = self._counted(self._checked(merge_parts(self._reduce(self._parts())), num_rows))
                write_atomically(self.out_path, lambda f: self._write_output(f, rows))
        shutil.rmtree(self.parts_dir, ignore_errors=True)
        self._finalized = True
        self._unlock(remove=True)

    def _counted(self, rows: Iterator[dict]) -> Iterator[dict]:
        self.error_rows = 0
        for row in rows:
            self.error_rows += row["finish_reason"] == "error"
            yield row

    def _write_output(self, f, rows: Iterator[dict]) -> None:
        rows = map(output_row, rows)
        if self.fmt == "parquet":
            schema = OUTPUT_SCHEMA
            if self.job is not None:
                schema = schema.with_metadata({JOB_META_KEY: json.dumps(self.job, sort_keys=True).encode()})
            write_parquet(f, rows, schema)
            return
        created = int(time.time())
        for row in rows:
            obj = (openai_line(row, self.model_name, created) if self.openai_output
                   else {k: row[k] for k in OUTPUT_COLUMNS})
            f.write(json.dumps(obj, ensure_ascii=False).encode() + b"\n")

    def close(self) -> None:
        """Save what is buffered (finished results are never thrown away)."""
        try:
            if not self._finalized:
                self.flush()
        finally:
            self._unlock(remove=True)  # safe while held (see _lock); a crash leaves it, harmlessly

    def __del__(self) -> None:
        # A dropped writer releases its lock as a dead process would; it does not flush.
        self._unlock(remove=False)

    def _lock_path(self) -> Path:
        return self.out_path.with_name(f".{self.out_path.name}.lock")

    def _unlock(self, remove: bool) -> None:
        if getattr(self, "_lock_fd", None) is None:
            return
        if remove:  # leave no dot file beside OUT; safe while we hold it (see _lock)
            try:
                self._lock_path().unlink(missing_ok=True)
            except OSError:
                pass  # a folder made read-only: the file stays, and holds no lock once closed
        os.close(self._lock_fd)  # closing drops the lock
        self._lock_fd = None

    def _lock(self) -> int:
        """One writer per OUT: a second job on the same output would merge and delete parts
        under the first. An flock dies with its process, so kill -9 leaves no stale lock."""
        path = self._lock_path()
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputError(f"another relay job is writing {self.out_path}; wait for it to end or stop it") \
                    from None
            # The holder before us may have removed the file after we opened it: then we
            # lock a name that no longer exists, and must lock the file now there instead.
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        # Flush even when the job failed or was interrupted: those rows are done and
        # a --resume run should not compute them again.
        self.close()

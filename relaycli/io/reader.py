"""Streaming request readers: JSONL line by line, Parquet batch by batch.

Memory stays flat however large the input: neither reader holds more than one
line or one record batch. An input also cuts into spans (JSONL byte ranges at line starts,
Parquet row groups) that other processes read apart with `read_span`, each row with the same
index and error text as in one reading of the whole file. A row that cannot be read becomes a parse error for that
row (the job goes on); only a file that cannot be opened at all raises InputError.

A job pins its input by the file's bytes (sha256) and identity (device, inode, size,
modification time). A file replaced, cut short or rewritten after it was opened is an
InputError, raised before any row of the changed bytes is handed on: the answers saved
so far are of the pinned file, and `--resume` refuses another file.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from relaycli.errors import RelayError
from relaycli.io.requests import RequestDefaults, RequestRow, ResultRow, parse_request, row_label

FORMATS = ("jsonl", "parquet")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_PARQUET_BATCH_ROWS = 1024  # rows a Parquet batch holds in memory at once
_BOM = b"\xef\xbb\xbf"
_CR = ord("\r")  # an int: `in` finds a byte value with memchr, several times faster than b"\r"
_SPLIT_ROWS = 64  # rows between the places a JSONL file may be cut into spans (doubles for large files)
_MAX_SPLITS = 1 << 16  # at most this many of them are kept

# (row_index, the row as a dict or None, a one-line parse error or None)
RawRow = tuple[int, "dict | None", "str | None"]
# A RawRow and the JSONL line the row is on (None for Parquet, which has no lines)
LocatedRow = tuple[int, "dict | None", "str | None", "int | None"]


class InputError(RelayError):
    """The input cannot be read at all; the message is one sentence for the user."""


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _stamp(st: os.stat_result) -> tuple[int, int]:
    """Size and modification time: the part of a file's identity that another node of a
    cluster sees the same on a shared file system (device and inode numbers differ there)."""
    return st.st_size, st.st_mtime_ns


def _changed(path: Path) -> InputError:
    return InputError(f"the input file {path} changed while the job ran (replaced, cut short or rewritten); put "
                      "the original back and run the same command with --resume")


def _open_pinned(path: Path, identity: tuple, pin_of: Callable = _identity) -> BinaryIO:
    """The input opened again for reading, refused unless it is still the file first opened
    (pin_of(stat) == identity)."""
    try:
        f = open(path, "rb", buffering=1 << 20)
    except FileNotFoundError:
        raise InputError(f"the input file {path} was removed while the job ran; put it back and run the same "
                         "command with --resume") from None
    except OSError as e:
        raise InputError(f"input file {path} cannot be read ({e.strerror})") from None
    if pin_of(os.fstat(f.fileno())) != identity:
        f.close()
        raise _changed(path)
    return f


def detect_format(path: str | Path, fmt: str | None = None) -> str:
    """'jsonl' or 'parquet': fmt when given, else from the file's extension."""
    if fmt is not None:
        if fmt.lower() not in FORMATS:
            raise InputError(f"unknown input format {fmt!r}; use one of: {', '.join(FORMATS)}")
        return fmt.lower()
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise InputError(f"cannot tell the format of {path} from its extension {suffix or '(none)'!r}; "
                         "name it .jsonl or .parquet, or pass --format jsonl or --format parquet")
    return _SUFFIXES[suffix]


class RequestSource(ABC):
    """An opened input: `num_rows` up front (for progress), then rows in file order."""

    def __init__(self, path: Path, fmt: str, num_rows: int, identity: tuple) -> None:
        self.path, self.fmt, self.num_rows, self.identity = path, fmt, num_rows, identity

    def __iter__(self) -> Iterator[RawRow]:
        return self._rows(located=False)

    def located(self) -> Iterator[LocatedRow]:
        """The rows in file order, each with the JSONL line it is on (for error rows)."""
        return self._rows(located=True)

    @abstractmethod
    def _rows(self, located: bool) -> Iterator[RawRow | LocatedRow]:
        """RawRows, or LocatedRows where located."""

    @abstractmethod
    def spans(self) -> list[Span]:
        """The input cut into consecutive spans that `read_span` reads apart, in any process."""

    def __len__(self) -> int:
        return self.num_rows

    def content_sha256(self) -> str:
        """sha256 of the file's bytes: what a resumed job's record pins the input by."""
        with _open_pinned(self.path, self.identity) as f:
            try:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as e:
                raise InputError(f"input file {self.path} cannot be read ({e.strerror})") from None
            if _identity(os.fstat(f.fileno())) != self.identity:
                raise _changed(self.path)
        return digest


def _lines(f, digest=None, at_end: Callable[[], None] | None = None, line_no: int = 0,
           end: int | None = None) -> Iterator[tuple[int, bytes, int | None]]:
    """(line number, line, offset) of an opened JSONL file from its position on, for counting
    and reading alike, so num_rows always equals the rows read. A UTF-8 BOM before the first
    line is not part of it. Lines end in LF, CRLF or a lone CR (old Mac line endings, alone or
    mixed with the others: _split_cr).
    offset: where the line starts in the file; None for a line after a lone CR, where a span
    cannot start. line_no: the lines before the position. end: stop at this offset, a line's start.
    digest: a hashlib object that is fed every byte read on the way.
    at_end(): called once the whole file (or range) is read, before its last line is yielded,
    so a check of all the bytes can stop a line cut short."""
    offset = f.tell()
    for physical in f:
        start, offset = offset, offset + len(physical)
        if digest is not None:
            digest.update(physical)
        if at_end is not None and (not physical.endswith(b"\n") or (end is not None and offset >= end)):
            at_end()
            at_end = None
        if line_no == 0:
            physical = physical.removeprefix(_BOM)
        physical = physical.removesuffix(b"\n").removesuffix(b"\r")
        if _CR in physical:  # iteration splits on LF only
            for k, line in enumerate(_split_cr(physical)):
                line_no += 1
                yield line_no, line, start if k == 0 else None
        else:
            line_no += 1
            yield line_no, physical, start
        if end is not None and offset >= end:
            break
    if at_end is not None:
        at_end()


def _is_json(text: bytes) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _split_cr(physical: bytes) -> list[bytes]:
    """The lines of a line read up to LF that holds a lone CR: the pieces its CRs end, unless
    its first piece is no JSON value on its own while the whole is one, where a CR stood as
    whitespace between tokens (a JSON string never holds a raw CR). Only lines with a CR pay
    for these parses, and a file of CR line endings only for its first row's."""
    pieces = physical.split(b"\r")
    if _is_blank(pieces[0]) or _is_json(pieces[0]) or not _is_json(physical):
        return pieces
    return [physical]


@dataclass(frozen=True)
class Span:
    """Consecutive rows of an input that read on their own, in another process or on another
    node (`read_span`): bytes [start, end) of a JSONL file, cut at line starts, or row groups
    [start, end) of a Parquet file. first_row is its first row's index and lines_before the
    JSONL lines before it, so its rows and error texts are those of the whole file's reading.
    pin: the file's size and modification time when it was planned."""
    path: Path
    fmt: str
    start: int
    end: int
    first_row: int
    num_rows: int
    lines_before: int
    pin: tuple[int, int]


def join_spans(spans: list[Span]) -> Span:
    """One span of consecutive spans."""
    return replace(spans[0], end=spans[-1].end, num_rows=sum(s.num_rows for s in spans))


def read_span(span: Span) -> Iterator[RawRow]:
    """The rows of a span: row indexes, rows and error texts exactly as iterating the whole
    input gives them. The file must still have the planned size and modification time, checked
    on opening and before the span's last row."""
    with _open_pinned(span.path, span.pin, _stamp) as f:
        def unchanged() -> None:
            if _stamp(os.fstat(f.fileno())) != span.pin:
                raise _changed(span.path)

        if span.fmt == "jsonl":
            f.seek(span.start)
            rows = _jsonl_rows(f, span.path, span.first_row, span.lines_before, span.end, at_end=unchanged)
        else:
            try:
                pf = pq.ParquetFile(f)
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"{span.path} is not a readable Parquet file ({_first_line(e)})") from None
            rows = _parquet_rows(pf, span.path, range(span.start, span.end), span.first_row, unchanged)
        count = 0
        for row in rows:
            count += 1
            yield row
        if count != span.num_rows:
            raise _changed(span.path)


def _refuse_wide_text(path: Path) -> None:
    """A Parquet file read as JSONL, and UTF-16 and UTF-32 files (PowerShell 5 writes UTF-16
    for `>`), split on b"\\n" into pieces that are neither rows nor blank: refuse the file
    instead of inventing rows."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        raise InputError(f"{path} is a Parquet file, not JSON Lines; leave out --format or pass --format parquet")
    wide = head.startswith((b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff"))
    nul_even, nul_odd = head[0::2].count(0), head[1::2].count(0)
    # Without a BOM: ASCII text in UTF-16 has a NUL in every other byte, all on one side
    # (a run of zeros, say from a crash, has them on both).
    wide = wide or (len(head) >= 8 and 3 * (nul_even + nul_odd) >= len(head)
                    and min(nul_even, nul_odd) * 10 <= max(nul_even, nul_odd))
    if wide:
        raise InputError(f"{path} is UTF-16 or UTF-32 text; relay reads UTF-8: save it as UTF-8 "
                         "(in PowerShell: Out-File -Encoding utf8)")


def _is_blank(line: bytes) -> bool:
    return not line.strip()


class JsonlSource(RequestSource):
    """One JSON object a line; blank lines are neither rows nor errors."""

    def __init__(self, path: Path) -> None:
        _refuse_wide_text(path)
        num_rows, first, digest = 0, None, hashlib.sha256()
        step, splits = _SPLIT_ROWS, []  # (offset, row index, lines before) where a span may start
        with open(path, "rb", buffering=1 << 20) as f:
            identity = _identity(os.fstat(f.fileno()))
            for line_no, line, start in _lines(f, digest):  # the counting pass also hashes: one read for both
                if not _is_blank(line):
                    if num_rows % step == 0 and num_rows and start is not None:
                        splits.append((start, num_rows, line_no - 1))
                        if len(splits) > _MAX_SPLITS:
                            splits, step = splits[1::2], 2 * step
                    num_rows += 1
                    if first is None:
                        first = line.strip()
            if _identity(os.fstat(f.fileno())) != identity:
                raise _changed(path)
        self._sha256 = digest.hexdigest()
        self._splits = splits
        if first in (b"[", b"{"):
            # A pretty-printed JSON document would otherwise turn into one error per line.
            raise InputError(f"{path} looks like pretty-printed JSON; relay reads JSON Lines: "
                             "one complete object on each line")
        super().__init__(path, "jsonl", num_rows, identity)

    def content_sha256(self) -> str:
        return self._sha256

    def spans(self) -> list[Span]:
        """The file cut at line starts into spans of about equal rows (at least 64 each, and
        at most 65,537 spans however large the file)."""
        size, pin = self.identity[2], (self.identity[2], self.identity[3])
        bounds = [(0, 0, 0), *self._splits, (size, self.num_rows, 0)]
        return [Span(self.path, "jsonl", a[0], b[0], a[1], b[1] - a[1], a[2], pin) for a, b in zip(bounds, bounds[1:])]

    def _rows(self, located: bool) -> Iterator[RawRow | LocatedRow]:
        digest = hashlib.sha256()

        def same_bytes() -> None:
            if digest.hexdigest() != self._sha256:
                raise _changed(self.path)

        with _open_pinned(self.path, self.identity) as f:
            yield from _jsonl_rows(f, self.path, 0, 0, None, digest, same_bytes, located)


def _jsonl_rows(f, path: Path, row_index: int, line_no: int, end: int | None, digest=None,
                at_end: Callable[[], None] | None = None, located: bool = False) -> Iterator[RawRow | LocatedRow]:
    """The rows of an opened JSONL file from its position (row row_index, after line_no lines)
    to end; with their line numbers where located."""
    try:
        for line_no, line, _ in _lines(f, digest, at_end, line_no, end):
            if _is_blank(line):
                continue
            raw, error = _parse_line(line, row_index, line_no)
            yield (row_index, raw, error, line_no) if located else (row_index, raw, error)
            row_index += 1
    except OSError as e:
        raise InputError(f"input file {path} could not be read to its end ({e.strerror}); "
                         "run the same command with --resume") from None


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _parse_line(line: bytes, row_index: int, line_no: int) -> tuple[dict | None, str | None]:
    where = row_label(row_index, line_no)
    try:
        value = json.loads(line)
    except UnicodeDecodeError:
        return None, f"{where}: not valid UTF-8; save the file as UTF-8"
    except json.JSONDecodeError as e:
        return None, f"{where}: not valid JSON ({e.msg} at column {e.colno}); write one JSON object per line"
    except RecursionError:
        return None, f"{where}: JSON nested too deeply to read; flatten the row"
    if not isinstance(value, dict):
        return None, (f"{where}: holds a JSON {_JSON_TYPES.get(type(value), type(value).__name__)}, not an object; "
                      "write one object with 'prompt' or 'messages' per line")
    return value, None


def _drop_nulls(row: dict) -> dict:
    # A Parquet column exists for every row; a null there means the row leaves it out.
    return {k: v for k, v in row.items() if v is not None}


class ParquetSource(RequestSource):
    """Parquet rows as dicts; nested columns (list<struct>, list<string>) come out as lists.

    Read one row group at a time: a group that cannot be decoded (damaged pages) gives an
    error row for each of its rows that was not read yet, and the next group is read, so
    a damaged group costs only its own rows and no row goes missing."""

    def __init__(self, path: Path) -> None:
        try:
            identity = _identity(os.stat(path))
            num_rows = pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{path} is not a readable Parquet file ({_first_line(e)})") from None
        super().__init__(path, "parquet", num_rows, identity)

    def spans(self) -> list[Span]:
        """One span per row group."""
        try:
            meta = pq.ParquetFile(self.path).metadata
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{self.path} is not a readable Parquet file ({_first_line(e)})") from None
        pin, spans, first = (self.identity[2], self.identity[3]), [], 0
        for group in range(meta.num_row_groups):
            rows = meta.row_group(group).num_rows
            spans.append(Span(self.path, "parquet", group, group + 1, first, rows, 0, pin))
            first += rows
        return spans

    def _rows(self, located: bool) -> Iterator[RawRow | LocatedRow]:
        with _open_pinned(self.path, self.identity) as f:
            try:
                pf = pq.ParquetFile(f)
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"{self.path} is not a readable Parquet file ({_first_line(e)})") from None

            def unchanged() -> None:
                if _identity(os.fstat(f.fileno())) != self.identity:
                    raise _changed(self.path)

            with pf:
                rows = _parquet_rows(pf, self.path, range(pf.metadata.num_row_groups), 0, unchanged)
                yield from ((*row, None) for row in rows) if located else rows


def _parquet_rows(pf: pq.ParquetFile, path: Path, groups: range, row_index: int,
                  unchanged: Callable[[], None]) -> Iterator[RawRow]:
    """The rows of row groups `groups` (the first row being row_index), one group at a time."""
    num_groups = pf.metadata.num_row_groups
    for group in groups:
        first, end = row_index, row_index + pf.metadata.row_group(group).num_rows
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group]):
                unchanged()  # rows read from a file rewritten meanwhile are not handed on
                for row in batch.to_pylist():
                    yield row_index, _drop_nulls(row), None
                    row_index += 1
        except (pa.ArrowException, OSError) as e:
            unchanged()  # a file cut short is no damaged row group
            why = (f"Parquet row group {group + 1} of {num_groups} (rows {first}-{end - 1}) could not be "
                   f"read ({_first_line(e)}); rewrite the file to answer this row")
            for lost in range(row_index, end):
                yield lost, None, f"{row_label(lost)}: {why}"
            row_index = end


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def open_requests(path: str | Path, fmt: str | None = None) -> RequestSource:
    """Open an input file; raises InputError with one sentence if that is not possible."""
    path = Path(path)
    kind = detect_format(path, fmt)
    if not path.exists():
        raise InputError(f"input file {path} does not exist")
    if not path.is_file():
        raise InputError(f"input {path} is not a file")
    try:
        return JsonlSource(path) if kind == "jsonl" else ParquetSource(path)
    except PermissionError:
        raise InputError(f"input file {path} cannot be read (permission denied)") from None


def read_requests(source: RequestSource | Iterable[RawRow], defaults: RequestDefaults | None = None,
                  skip: Set[int] = frozenset()) -> Iterator[RequestRow | ResultRow]:
    """Rows ready for the engine: RequestRows, and error ResultRows for bad rows, which a
    RequestSource's rows name by their JSONL line too.

    `skip` holds the rows a resumed job already has (ResultWriter.done_row_indices()).
    """
    rows = source.located() if isinstance(source, RequestSource) else ((*row, None) for row in source)
    for row_index, raw, error, line in rows:
        if row_index in skip:
            continue
        if error is not None:
            yield ResultRow.failed(row_index, str(row_index), error)
        else:
            yield parse_request(raw, row_index, defaults, line)

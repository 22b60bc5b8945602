"""Part files of a job's output: the schema, atomic writes, and the ordered merge.

A part is a Parquet file of finished rows sorted by row_index, written whole or not at
all (temp name, fsync, rename, fsync of the folder). The writer (writer.py) decides when
parts are written, reduced and merged into OUT.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from relaycli.io.failures import read_failure

BASE_COLUMNS = ("id", "text", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens", "error")
# Per generated token: its text, log-probability, UTF-8 bytes and the top alternatives.
_TOP = pa.struct([pa.field("token", pa.string()), pa.field("logprob", pa.float64()),
                  pa.field("bytes", pa.list_(pa.int32()))])
LOGPROBS_TYPE = pa.list_(pa.struct([pa.field("token", pa.string()), pa.field("logprob", pa.float64()),
                                    pa.field("bytes", pa.list_(pa.int32())),
                                    pa.field("top_logprobs", pa.list_(_TOP))]))
COMPLETIONS_TYPE = pa.list_(pa.struct([
    pa.field("index", pa.int64()), pa.field("text", pa.string()), pa.field("finish_reason", pa.string()),
    pa.field("completion_tokens", pa.int64()), pa.field("logprobs", LOGPROBS_TYPE)]))
# logprobs: null unless the row asks; completions: null unless the row asks for n > 1.
EXTRA_COLUMNS = ("logprobs", "completions")
OUTPUT_COLUMNS = BASE_COLUMNS + EXTRA_COLUMNS
OUTPUT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False), pa.field("text", pa.string(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("prompt_tokens", pa.int64(), nullable=False), pa.field("cached_tokens", pa.int64(), nullable=False),
    pa.field("completion_tokens", pa.int64(), nullable=False), pa.field("error", pa.string()),
    pa.field("logprobs", LOGPROBS_TYPE), pa.field("completions", COMPLETIONS_TYPE),
])
# Parts also keep the row index (for ordering and resume) and the OpenAI url (for its output
# shape); they hold logprobs and completions as JSON text (two columns, not a dozen nested
# ones in every small part's footer), which the final output turns back (output_row).
PART_SCHEMA = pa.schema([pa.field("row_index", pa.int64(), nullable=False),
                         *(OUTPUT_SCHEMA.field(name) for name in BASE_COLUMNS),
                         *(pa.field(name, pa.string()) for name in EXTRA_COLUMNS), pa.field("url", pa.string())])
TMP = ".tmp-"  # prefix of every file not yet renamed into place; never a finished part
MERGE_ROWS = 16384  # rows the readers of one merge hold at once, together: its memory whatever the job's size
WRITE_ROWS = 4096  # rows per Parquet batch of the output


def fsync_dir(path: Path) -> None:
    # The rename itself is only durable once the folder entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write) -> None:
    """write(file) into a temp sibling, fsync, rename onto path: readers see all or nothing."""
    tmp = path.with_name(f"{TMP}{path.name}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only or vanished folder; a leftover temp file is never taken for a part
        raise
    fsync_dir(path.parent)


def write_json(path: Path, data) -> None:
    """data as indented JSON (values JSON has no type for as str), written atomically."""
    text = json.dumps(data, indent=2, default=str) + "\n"
    write_atomically(Path(path), lambda f: f.write(text.encode("utf-8")))


def rows_table(rows: list[dict]) -> pa.Table:
    """A part of result rows (ResultRow fields): logprobs and completions as JSON text."""
    def value(r: dict, name: str):
        v = r[name]
        return json.dumps(v, ensure_ascii=False) if name in EXTRA_COLUMNS and v is not None else v
    return pa.Table.from_pydict({f.name: [value(r, f.name) for r in rows] for f in PART_SCHEMA}, schema=PART_SCHEMA)


def output_row(part_row: dict) -> dict:
    """A row read from a part, its logprobs and completions back as lists."""
    for name in EXTRA_COLUMNS:
        if part_row[name] is not None:
            part_row[name] = json.loads(part_row[name])
    return part_row


def read_part(path: Path, batch_rows: int = 512) -> Iterator[dict]:
    """A part's rows, batch_rows at a time; OutputError (read_failure) when it cannot be
    read back whole."""
    try:
        with pq.ParquetFile(path) as pf:
            for batch in pf.iter_batches(batch_size=batch_rows):
                yield from batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise read_failure(path, exc) from None


def part_row_indices(path: Path) -> list[int] | None:
    """The rows a saved part answers, or None when any of it cannot be read back: the merge
    reads every column, so a part is only counted as done when all of it is sound."""
    try:
        table = pq.read_table(path)
        if not table.schema.equals(PART_SCHEMA, check_metadata=False):
            return None
        table.validate(full=True)  # also checks that every string is UTF-8
        return table.column("row_index").to_pylist()
    except (pa.ArrowException, OSError):
        return None


def merge_parts(paths: list[Path]) -> Iterator[dict]:
    """Rows of sorted parts in row order; a row found in two parts (a crash mid-merge) once."""
    last = None
    batch_rows = max(64, MERGE_ROWS // max(1, len(paths)))
    for row in heapq.merge(*(read_part(p, batch_rows) for p in paths), key=lambda r: r["row_index"]):
        if row["row_index"] != last:
            last = row["row_index"]
            yield row


def batches(rows: Iterator[dict], size: int) -> Iterator[list[dict]]:
    while batch := list(itertools.islice(rows, size)):
        yield batch


def write_parquet(f, rows: Iterator[dict], schema: pa.Schema) -> None:
    with pq.ParquetWriter(f, schema) as w:
        for batch in batches(rows, WRITE_ROWS):
            w.write_table(pa.Table.from_pydict({n: [r[n] for r in batch] for n in schema.names}, schema=schema))

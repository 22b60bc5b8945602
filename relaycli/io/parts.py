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
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUTPUT_COLUMNS = ("id", "text", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens", "error")
OUTPUT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False), pa.field("text", pa.string(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("prompt_tokens", pa.int64(), nullable=False), pa.field("cached_tokens", pa.int64(), nullable=False),
    pa.field("completion_tokens", pa.int64(), nullable=False), pa.field("error", pa.string()),
])
# Parts also keep the row index (for ordering and resume) and the OpenAI url (for its output shape).
PART_SCHEMA = pa.schema([pa.field("row_index", pa.int64(), nullable=False), *OUTPUT_SCHEMA,
                          pa.field("url", pa.string())])
TMP = ".tmp-"  # prefix of every file not yet renamed into place; never a finished part
READ_ROWS = 512  # rows a part reader holds at once during the merge
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
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, data) -> None:
    """data as indented JSON (values JSON has no type for as str), written atomically."""
    text = json.dumps(data, indent=2, default=str) + "\n"
    write_atomically(Path(path), lambda f: f.write(text.encode("utf-8")))


def rows_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pydict({f.name: [r[f.name] for r in rows] for f in PART_SCHEMA}, schema=PART_SCHEMA)


def read_part(path: Path) -> Iterator[dict]:
    with pq.ParquetFile(path) as pf:
        for batch in pf.iter_batches(batch_size=READ_ROWS):
            yield from batch.to_pylist()


def merge_parts(paths: Iterable[Path]) -> Iterator[dict]:
    """Rows of sorted parts in row order; a row found in two parts (a crash mid-merge) once."""
    last = None
    for row in heapq.merge(*(read_part(p) for p in paths), key=lambda r: r["row_index"]):
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

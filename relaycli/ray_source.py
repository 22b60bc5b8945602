"""relay's input file as a Ray Data source, read in place by Ray's read tasks.

    ds = ray.data.read_datasource(RequestDatasource("in.jsonl", min_blocks=gpus))

The driver opens the input with relay's reader (its checks, and one streaming pass that
counts the rows and notes where the file may be cut) and plans read tasks: JSONL byte
ranges cut at line starts, Parquet row groups. Each task reads its range with relay's
reader, so a row has the same `row_index`, JSON text and error as in a local job. Rows
come out as {row_index, request (JSON text, None for an unreadable row), read_error},
which `RelayPredictor` takes as they are. The input is never held on the driver.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from relaycli.io.reader import RequestSource, Span, join_spans, open_requests, read_span

ROW_SCHEMA = pa.schema([pa.field("row_index", pa.int64(), nullable=False), pa.field("request", pa.string()),
                        pa.field("read_error", pa.string())])
BLOCK_ROWS = 4096  # rows a block holds at least, where the input has enough


class RequestDatasource(Datasource):
    def __init__(self, source: str | Path | RequestSource, fmt: str | None = None, *, min_blocks: int = 1,
                 block_rows: int = BLOCK_ROWS) -> None:
        """source: an input path (format from its extension, or fmt) or an opened RequestSource.
        Few large blocks: about num_rows / block_rows of them, and at least min_blocks (one
        per GPU), since an actor answers the batches of one block into one engine at once."""
        super().__init__()
        if not isinstance(source, RequestSource):
            source = open_requests(Path(source).resolve(), fmt)  # resolved: read tasks run elsewhere
        self.num_rows = source.num_rows
        self._spans = source.spans()
        self._blocks = max(min_blocks, math.ceil(self.num_rows / block_rows), 1)

    def get_name(self) -> str:
        return "RelayRequests"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        """One task per group of consecutive spans; the block count is the source's own
        (parallelism is not used: blocks follow rows, not cores)."""
        return [ReadTask(lambda span=span: [_read_block(span)],
                         BlockMetadata(num_rows=span.num_rows, size_bytes=None, exec_stats=None,
                                       input_files=[str(span.path)]),
                         schema=ROW_SCHEMA, per_task_row_limit=per_task_row_limit)
                for span in self.read_spans()]

    def read_spans(self) -> list[Span]:
        """The spans of the read tasks: consecutive spans joined into self._blocks groups of
        about equal rows (fewer where the input has fewer places to cut)."""
        groups, group, done = [], [], 0
        for span in self._spans:
            group.append(span)
            done += span.num_rows
            if done * self._blocks >= (len(groups) + 1) * self.num_rows and done < self.num_rows:
                groups.append(join_spans(group))
                group = []
        return groups + [join_spans(group)] if group else groups


def _read_block(span: Span) -> pa.Table:
    """A span's rows as one block; a file changed since planning raises before any row leaves."""
    index, request, error = [], [], []
    for i, raw, why in read_span(span):
        index.append(i)
        request.append(None if why is not None else json.dumps(raw, default=str))
        error.append(why)
    return pa.Table.from_pydict({"row_index": index, "request": request, "read_error": error}, schema=ROW_SCHEMA)

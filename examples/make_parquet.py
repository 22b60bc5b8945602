"""Convert a relay JSONL request file to Parquet with typed, nested columns.

    python examples/make_parquet.py examples/requests.jsonl examples/requests.parquet

`messages` becomes list<struct<role, content>> and `stop` list<string>; a field a
row leaves out becomes null, which relay reads as "absent". The schema is spelled
out so that, e.g., `temperature: 0` in one row and `0.7` in another are one float
column, not a type clash.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema([
    ("id", pa.string()), ("prompt", pa.string()), ("messages", pa.list_(MESSAGE)),
    ("system_prompt", pa.string()), ("max_tokens", pa.int64()), ("temperature", pa.float64()),
    ("top_p", pa.float64()), ("top_k", pa.int64()), ("seed", pa.int64()), ("stop", pa.list_(pa.string())),
])


def convert(src: Path, dst: Path) -> int:
    rows = []
    with open(src, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            unknown = set(row) - set(SCHEMA.names)
            if unknown:
                sys.exit(f"{src}:{line_no}: fields {sorted(unknown)} have no column here; add them to SCHEMA")
            if isinstance(row.get("stop"), str):
                row["stop"] = [row["stop"]]  # one column type: a list of strings
            rows.append(row)
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    # Drop columns no row uses, so the file shows only what the requests set.
    table = table.select([n for n in table.column_names if table[n].null_count < table.num_rows])
    pq.write_table(table, dst)
    return table.num_rows


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python examples/make_parquet.py REQUESTS.jsonl OUT.parquet")
    n = convert(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"wrote {n} rows to {sys.argv[2]}")

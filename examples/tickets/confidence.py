"""Print each ticket's label with its confidence: the probability of the whole label
under the constrained distribution, exp(sum of its tokens' logprobs).

    python examples/tickets/confidence.py triage.parquet
"""

import math
import sys

import pyarrow.parquet as pq

for row in pq.read_table(sys.argv[1] if len(sys.argv) > 1 else "triage.parquet").to_pylist():
    if row["finish_reason"] == "error":
        print(f"{row['id']:<14} error: {row['error']}")
    elif row["logprobs"] is not None:
        confidence = math.exp(sum(t["logprob"] for t in row["logprobs"]))
        print(f"{row['id']:<14} {row['text']:<16} {confidence:6.1%}")
    else:
        print(f"{row['id']:<14} {row['text']}")

"""Request files that measure what structured answers cost, as `relay run` inputs:

  plain.jsonl        ROWS rows, unconstrained
  json.jsonl         the same rows, each with the same small JSON schema
  constrained.jsonl  the same rows, each with a JSON schema (a third), a regex (a third) or choices
  logprobs.jsonl     the same rows, each asking for logprobs with 5 alternatives
  n4.jsonl           ROWS / 4 rows asking for n = 4
  n1x4.jsonl         the same ROWS / 4 prompts, each as 4 rows of n = 1 (seeds as n = 4 uses)

Every row samples (temperature 1) and ignores EOS, so rows of a pair generate alike
(constrained rows still end where their grammar ends). Compare the runs' generated
tokens per second from --stats-json.

    python examples/structured_workload.py OUTDIR [--rows 1000] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relaycli.io.requests import derive_seed

SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["billing", "bug", "other"]},
                                           "reason": {"type": "string"}}, "required": ["label", "reason"]}
TOPICS = ["an invoice", "a crash", "a login", "an export", "a refund", "the calendar", "a report", "a plan"]


def _base(i: int, max_tokens: int) -> dict:
    return {"id": f"r{i}", "prompt": f"Question {i}: what should I do about {TOPICS[i % len(TOPICS)]}?",
            "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "seed": i}


def _constraint(i: int) -> dict:
    kind = i % 3
    if kind == 0:
        return {"json_schema": SCHEMA}
    if kind == 1:
        return {"regex": "[A-Za-z ,.]+"}
    return {"choices": ["billing", "bug report", "feature request", "other"]}


def write(out: Path, rows: int, max_tokens: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "plain": [_base(i, max_tokens) for i in range(rows)],
        "json": [{**_base(i, max_tokens), "json_schema": SCHEMA} for i in range(rows)],
        "constrained": [{**_base(i, max_tokens), **_constraint(i)} for i in range(rows)],
        "logprobs": [{**_base(i, max_tokens), "logprobs": True, "top_logprobs": 5} for i in range(rows)],
        "n4": [{**_base(i, max_tokens), "n": 4} for i in range(rows // 4)],
        "n1x4": [{**_base(i, max_tokens), "id": f"r{i}-{k}", "seed": i if k == 0 else derive_seed(i, k)}
                 for i in range(rows // 4) for k in range(4)],
    }
    for name, lines in files.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    write(args.out, args.rows, args.max_tokens)


if __name__ == "__main__":
    main()

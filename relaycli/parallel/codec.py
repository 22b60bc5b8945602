"""Messages between a `--devices` parent and its workers: one JSON object each, as bytes.

The parent reads and validates the rows; a worker gets them as plain JSON (a RequestRow's
fields) and sends back its result rows the same way. `send` and `recv` use a
multiprocessing Connection's send_bytes/recv_bytes, so no process ever unpickles what it
receives. Every message has a "type":

- parent -> worker: `rows` {rows: [request]}, `end` (no more rows: finish and report)
- worker -> parent: `ready` {device, fingerprint, ...}, `result` {row}, `beat` {stats: the
  engine's counters, every second}, `done` {stats}, `failed` {message, refusal} (a refusal
  is the user's to fix, one sentence)
"""

from __future__ import annotations

import dataclasses
import json

from relaycli.io.requests import RequestRow, ResultRow, SamplingParams
from relaycli.io.structured import ConstraintSpec


def send(conn, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode("ascii"))  # ASCII: a lone surrogate travels as its escape


def recv(conn) -> dict:
    """The next message; EOFError when the other process is gone."""
    message = json.loads(conn.recv_bytes())
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ValueError(f"a relay worker message must be an object with a type, got {str(message)[:60]}")
    return message


def request_message(row: RequestRow) -> dict:
    return dataclasses.asdict(row)


def request_row(message: dict) -> RequestRow:
    """The RequestRow again, validated again by its own checks."""
    fields = dict(message)
    fields["sampling"] = SamplingParams(**fields["sampling"])
    if fields.get("constraint") is not None:
        fields["constraint"] = ConstraintSpec(**fields["constraint"])
    return RequestRow(**fields)


def result_message(result: ResultRow) -> dict:
    return dict(vars(result))


def result_row(message: dict) -> ResultRow:
    return ResultRow(**message)

"""A finished OUT: the OpenAI batch line a row becomes, and reading OUT back.

`--resume` on a finished OUT checks it instead of writing it again: its rows (ids in
input order, every one there) and, for Parquet, the job record kept in its metadata.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from relaycli.io.failures import OutputError
from relaycli.io.requests import OPENAI_URLS
from relaycli.errors import clipped

JOB_META_KEY = b"relay.job"  # the job record, in a finished Parquet OUT's key-value metadata


def openai_line(row: dict, model: str, created: int) -> dict:
    """One line of the OpenAI Batch output format, with ids derived from the row (stable on rerun)."""
    digest = hashlib.sha256(f"{row['row_index']}:{row['id']}".encode()).hexdigest()
    line = {"id": f"batch_req_{digest[:24]}", "custom_id": row["id"], "response": None, "error": None}
    if row["finish_reason"] == "error":
        line["error"] = {"code": "relay_error", "message": row["error"]}
        return line
    chat = row["url"] != OPENAI_URLS[1]
    completions = row.get("completions") or [{"index": 0, "text": row["text"], "finish_reason": row["finish_reason"],
                                               "logprobs": row.get("logprobs")}]
    choices = []
    for c in completions:
        choice = {"index": c["index"], "logprobs": _openai_logprobs(c["logprobs"], chat),
                  "finish_reason": c["finish_reason"]}
        choice.update({"message": {"role": "assistant", "content": c["text"]}} if chat else {"text": c["text"]})
        choices.append(choice)
    usage = {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
             "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
             "prompt_tokens_details": {"cached_tokens": row["cached_tokens"]}}
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{digest[24:48]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage}
    line["response"] = {"status_code": 200, "request_id": digest[48:64], "body": body}
    return line


def _openai_logprobs(entries: list[dict] | None, chat: bool) -> dict | None:
    """OpenAI's logprobs object: chat's {content: [...]}, or the completions endpoint's
    {tokens, token_logprobs, top_logprobs, text_offset}."""
    if entries is None:
        return None
    if chat:
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                             "top_logprobs": [dict(t) for t in e["top_logprobs"]]} for e in entries],
                "refusal": None}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def complete_rows(path: Path, fmt: str) -> Iterator[tuple[str, bool]]:
    """(id, is_error) of each row of a finished OUT; OutputError if it is not whole."""
    try:
        if fmt == "parquet":
            with pq.ParquetFile(path) as pf:
                for batch in pf.iter_batches(batch_size=4096, columns=["id", "finish_reason"]):
                    for i, reason in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                        yield i, reason == "error"
            return
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                if "custom_id" in row:  # an OpenAI Batch output line
                    yield row["custom_id"], row.get("error") is not None
                else:
                    yield row["id"], row["finish_reason"] == "error"
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError) as e:
        raise OutputError(f"{path} exists but is not a whole relay output ({type(e).__name__}); "
                          "remove it and run the job again") from None


def job_record_of(path: Path, fmt: str) -> dict | None:
    """The job record a finished OUT keeps: None where it has no place for one (JSONL, whose
    row ids are checked instead), {} where what it holds is no job's record."""
    if fmt != "parquet":
        return None
    try:
        meta = pq.read_schema(path).metadata or {}
        record = json.loads(meta[JOB_META_KEY]) if JOB_META_KEY in meta else None
    except (pa.ArrowException, OSError, ValueError):
        return None
    return record if isinstance(record, dict) else {}


def differing_keys(job: dict, stored: dict) -> list[str]:
    """The fields in which two job records disagree (one having a field the other lacks too)."""
    return sorted(k for k in set(job) | set(stored) if job.get(k) != stored.get(k))


# The job record's defaults (RequestDefaults) by the `relay run` option that sets them.
_DEFAULT_OPTIONS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "seed_base": "--seed",
                    "ignore_eos": "--ignore-eos"}


def _value(v) -> str:
    """A record's value as an option's value is written: text bare, the rest as JSON."""
    return clipped(v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str))


def _changes(job: dict, stored: dict) -> tuple[list[str], list[str]]:
    """How the stored job was run unlike this one, in the options' words, each as
    `--temperature 1.0 (now 0.5)`, and the fields its record lacks; the input is the caller's."""
    changes, missing = [], []
    for key in differing_keys(job, stored):
        if key not in stored:
            missing.append(key)
        elif key == "input_sha256":
            continue
        elif key == "model_fingerprint":
            changes.append("another model")
        elif key == "prompts":
            changes.append("other --prompt artifacts")
        elif key == "defaults" and isinstance(job.get(key), dict) and isinstance(stored[key], dict):
            for name in differing_keys(job[key], stored[key]):
                option = _DEFAULT_OPTIONS.get(name, f"default {name}")
                changes.append(f"{option} {_value(stored[key].get(name))} (now {_value(job[key].get(name))})")
        else:
            option = "--dtype" if key == "dtype" else key
            changes.append(f"{option} {_value(stored[key])} (now {_value(job.get(key))})")
    return changes, missing


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def another_job(what: str, job: dict, stored: dict, fix: str, start_over: str) -> OutputError:
    """`what` (e.g. "OUT holds the answers") belongs to another job: say how that job was run
    unlike this one (the option and both values) and the fix. A changed input, the case a
    user meets most, says so in words."""
    if not stored:
        return OutputError(f"{what} of another job (its job record cannot be read); {fix}")
    changes, missing = _changes(job, stored)
    lacks = f" (its job record lacks {', '.join(missing)})" if missing else ""
    if "input_sha256" in stored and job.get("input_sha256") != stored["input_sha256"]:
        also = f", and that job ran with {_and(changes)}" if changes else ""
        return OutputError(f"{what} of another job: the input file changed since those answers were saved{also}"
                           f"{lacks}; put the original input back to resume, or {start_over}")
    ran = f", run with {_and(changes)}" if changes else ""
    return OutputError(f"{what} of another job{ran}{lacks}; {fix}")

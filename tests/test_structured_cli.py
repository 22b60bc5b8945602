"""`relay run` with structured rows, as a user runs it: OpenAI Batch lines asking for n,
logprobs and a JSON schema give OpenAI output lines; a Parquet input holding choices and
a schema as JSON text gives the logprobs and completions columns; bad rows are error rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
          "required": ["colour"]}


def relay(*args) -> None:
    cmd = [sys.executable, "-c", "from relaycli.cli import entry; entry()", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def _line(cid: str, content: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0, **body}}


def test_openai_lines_with_n_logprobs_and_schema(tmp_path):
    lines = [_line("n2", "Pick a colour.", n=2, temperature=0.8, seed=3, logprobs=True, top_logprobs=2),
             _line("schema", "A colour as JSON.", response_format={
                 "type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": SCHEMA}}),
             _line("bad", "x", top_logprobs=30, logprobs=True)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    relay("run", "--in", src, "--out", out, "--quiet")
    got = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    choices = got["n2"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        content = c["logprobs"]["content"]
        assert content and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
    message = got["schema"]["response"]["body"]["choices"][0]
    assert message["finish_reason"] == "stop"
    jsonschema.validate(json.loads(message["message"]["content"]), SCHEMA)
    assert "'top_logprobs' must be an integer from 0 to 20" in got["bad"]["error"]["message"]


def test_parquet_rows_with_choices_and_schema_text(tmp_path):
    table = pa.table({"id": ["a", "b", "c"], "prompt": ["Is fire hot?", "A colour as JSON.", "Hello"],
                      "choices": [["yes", "no"], None, None], "json_schema": [None, json.dumps(SCHEMA), None],
                      "logprobs": [True, None, None], "max_tokens": [6, 16, 2], "temperature": [0.0, 0.0, 0.0],
                      "regex": [None, None, "(("]})
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(table, src)
    relay("run", "--in", src, "--out", out, "--quiet")
    rows = pq.read_table(out).to_pylist()
    assert rows[0]["text"] in ("yes", "no") and rows[0]["logprobs"][0]["token"] == rows[0]["text"][:len(
        rows[0]["logprobs"][0]["token"])]
    assert rows[1]["finish_reason"] == "stop" and json.loads(rows[1]["text"])["colour"] in ("red", "blue")
    assert rows[1]["logprobs"] is None and rows[1]["completions"] is None
    assert rows[2]["finish_reason"] == "error" and "'regex'" in rows[2]["error"]

"""Structured answers in the output: the logprobs and completions columns (Parquet, JSONL)
and OpenAI batch lines (a choices list, OpenAI's logprobs objects), kept through parts,
merge and resume."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from relaycli.io.requests import ResultRow
from relaycli.io.writer import OUTPUT_COLUMNS, ResultWriter


def _lp(token: str, value: float, alts=()) -> dict:
    return {"token": token, "logprob": value, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alts]}


LOGPROBS = [_lp("yes", -0.1, [("yes", -0.1), ("no", -2.4)]), _lp("!", -0.5, [("!", -0.5), (".", -1.0)])]
COMPLETIONS = [{"index": 0, "text": "yes!", "finish_reason": "stop", "completion_tokens": 3, "logprobs": LOGPROBS},
               {"index": 1, "text": "no", "finish_reason": "length", "completion_tokens": 2,
                "logprobs": [_lp("no", -2.4, [("no", -2.4)]), _lp("pe", -3.0, [("pe", -3.0)])]}]


def _rows(url=None) -> list[ResultRow]:
    return [ResultRow(0, "a", "yes!", "stop", 10, 0, 5, url=url, logprobs=LOGPROBS, completions=COMPLETIONS),
            ResultRow(1, "b", "plain", "length", 10, 0, 4, url=url),
            ResultRow(2, "c", "maybe", "stop", 10, 0, 2, url=url, logprobs=[_lp("maybe", -1.5)])]


def _write(out, rows, **kw):
    with ResultWriter(out, flush_rows=2, **kw) as w:
        for r in reversed(rows):
            w.write(r)
        w.finalize(len(rows))


def test_parquet_keeps_nested_logprobs_and_completions(tmp_path):
    out = tmp_path / "o.parquet"
    _write(out, _rows())
    rows = pq.read_table(out).to_pylist()
    assert list(rows[0]) == list(OUTPUT_COLUMNS)
    assert rows[0]["logprobs"] == LOGPROBS and rows[0]["completions"] == COMPLETIONS
    assert rows[1]["logprobs"] is None and rows[1]["completions"] is None
    assert rows[2]["logprobs"][0]["top_logprobs"] == [] and rows[2]["completions"] is None


def test_jsonl_has_the_same_columns(tmp_path):
    out = tmp_path / "o.jsonl"
    _write(out, _rows())
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(list(r) == list(OUTPUT_COLUMNS) for r in rows)
    assert rows[0]["completions"] == COMPLETIONS and rows[0]["logprobs"] == LOGPROBS
    assert rows[1]["logprobs"] is None and rows[1]["completions"] is None
    assert rows[2]["completions"] is None and rows[2]["logprobs"][0]["token"] == "maybe"


def test_parts_hold_the_structured_columns_as_json_text(tmp_path):
    out = tmp_path / "o.parquet"
    with ResultWriter(out, flush_rows=1) as w:
        w.write(_rows()[0])
        part = next(p for p in (tmp_path / "o.parquet.parts").iterdir() if p.suffix == ".parquet")
        stored = pq.read_table(part).to_pylist()[0]
        assert json.loads(stored["logprobs"]) == LOGPROBS and json.loads(stored["completions"]) == COMPLETIONS


def test_openai_lines_carry_choices_and_logprobs(tmp_path):
    out = tmp_path / "o.jsonl"
    _write(out, _rows("/v1/chat/completions"), openai_output=True)
    first, plain, one = (json.loads(line)["response"]["body"] for line in out.read_text().splitlines())
    choices = first["choices"]
    assert [c["index"] for c in choices] == [0, 1] and [c["message"]["content"] for c in choices] == ["yes!", "no"]
    assert [c["finish_reason"] for c in choices] == ["stop", "length"]
    content = choices[0]["logprobs"]["content"]
    assert content[0] == {"token": "yes", "logprob": -0.1, "bytes": [121, 101, 115],
                          "top_logprobs": [{"token": "yes", "logprob": -0.1, "bytes": [121, 101, 115]},
                                           {"token": "no", "logprob": -2.4, "bytes": [110, 111]}]}
    assert first["usage"]["completion_tokens"] == 5
    assert plain["choices"][0]["logprobs"] is None and len(plain["choices"]) == 1
    assert one["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_openai_completions_endpoint_logprobs(tmp_path):
    out = tmp_path / "o.jsonl"
    _write(out, _rows("/v1/completions"), openai_output=True)
    body = json.loads(out.read_text().splitlines()[0])["response"]["body"]
    lp = body["choices"][0]["logprobs"]
    assert lp == {"tokens": ["yes", "!"], "token_logprobs": [-0.1, -0.5],
                  "top_logprobs": [{"yes": -0.1, "no": -2.4}, {"!": -0.5, ".": -1.0}], "text_offset": [0, 3]}
    assert body["choices"][1]["text"] == "no"


def test_resume_keeps_structured_columns(tmp_path):
    out = tmp_path / "o.parquet"
    rows = _rows()
    w = ResultWriter(out, flush_rows=1)
    w.write(rows[0])
    w.flush()
    w.close()
    with ResultWriter(out, resume=True) as again:
        assert 0 in again.done_row_indices()
        for r in rows[1:]:
            again.write(r)
        again.finalize(3)
    assert pq.read_table(out).to_pylist()[0]["completions"] == COMPLETIONS

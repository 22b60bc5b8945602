"""What relay tells a user about a request file: error rows that name the row's line and
id, near-miss field names, range hints that fit the value, mixed line endings, and
refusals that name the option or command that fixes them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relaycli.artifact import ArtifactError, read_artifact
from relaycli.io.outfile import another_job
from relaycli.io.reader import InputError, detect_format, open_requests, read_requests, read_span
from relaycli.io.requests import RequestDefaults, RequestRow, ResultRow, parse_request


def relay(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from relaycli.cli import entry; entry()", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def errors_of(path) -> dict[int, str]:
    return {r.row_index: r.error for r in read_requests(open_requests(path)) if isinstance(r, ResultRow)}


# -- every error row of a JSONL input names its line, and its id where it has one --------

def test_jsonl_error_rows_name_the_line_and_the_id(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "a", "prompt": "Hi"}\n'
                    "\n\n"  # blank lines are no rows: rows and lines part ways
                    '{"id": "abc", "prompt": "Hi", "presence_penalty": 0.5}\n'
                    '{"prompt": "Hi", "temperature": -1}\n'
                    '{"id": "x", "prompt": \n'
                    '{"id": 42, "prompt": ""}\n')
    errors = errors_of(path)
    assert errors == {
        1: "row 1 (line 4, id \"abc\"): 'presence_penalty' = 0.5 is not supported (relay does not implement it); "
           "remove the field",
        2: "row 2 (line 5): 'temperature' must be a number >= 0 (0 = greedy), got -1; fix the value or leave the "
           "field out to use the default",
        3: "row 3 (line 6): not valid JSON (Expecting value at column 23); write one JSON object per line",
        4: "row 4 (line 7, id \"42\"): 'prompt' is empty; give it the user's message",
    }


def test_openai_lines_are_named_by_their_custom_id(tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text("\n" + json.dumps({"custom_id": "req-9", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"messages": [{"role": "user", "content": "Hi"}], "n": 0}}) + "\n")
    assert errors_of(path)[0].startswith("row 0 (line 2, id \"req-9\"): 'n' must be an integer from 1 to 16")


def test_parquet_error_rows_name_the_row_and_its_id(tmp_path):
    path = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "ok", "prompt": "Hi", "top_k": None},
                                         {"id": "p1", "prompt": "Hi", "top_k": 0},
                                         {"id": None, "prompt": "Hi", "top_k": 0}]), path)
    errors = errors_of(path)
    assert sorted(errors) == [1, 2]
    assert errors[1].startswith("row 1 (id \"p1\"): 'top_k' must be an integer >= 1")
    assert errors[2].startswith("row 2: 'top_k' must be an integer >= 1")


def test_a_long_id_is_cut_and_rows_without_a_line_keep_the_plain_label():
    long_id = "x" * 100
    got = parse_request({"id": long_id, "prompt": ""}, 3)
    assert got.id == long_id and got.error.startswith('row 3 (id "' + "x" * 35 + '..."): ')
    # read_requests over plain (row_index, raw, error) rows: no lines to name
    got, = read_requests([(5, {"id": "q", "prompt": ""}, None)])
    assert got.error.startswith("row 5 (id \"q\"): 'prompt' is empty")


# -- a field name close to a known one is a typo; any other unknown field is allowed ----

@pytest.mark.parametrize("field, meant", [
    ("max_token", "max_tokens"), ("temprature", "temperature"), ("topP", "top_p"), ("top-k", "top_k"),
    ("Max_Tokens", "max_tokens"), ("ID", "id"), ("seeds", "seed"), ("stop_sequence", None), ("promt", "prompt"),
    ("system_promt", "system_prompt"), ("ignore_eso", "ignore_eos"), ("reponse_format", "response_format"),
])
def test_a_near_miss_of_a_known_field_is_an_error_row(field, meant):
    got = parse_request({"id": "unk", "prompt": "Hi", field: 5}, 0)
    if meant is None:
        assert isinstance(got, RequestRow)
        return
    assert isinstance(got, ResultRow) and got.id == "unk"
    assert got.error == (f"row 0 (id \"unk\"): unknown field '{field}'; did you mean '{meant}'? Rename it (a column "
                         "of your own needs a name unlike relay's fields)")


def test_own_columns_ride_along_and_change_nothing():
    plain = parse_request({"id": "a", "prompt": "Hi", "max_tokens": 5}, 0)
    own = {"label": "spam", "ids": [1, 2], "uid": "u1", "metadata": {"k": 1}, "category": "x", "source": "web",
           "expected": "yes", "notes": "", "model": "gpt-4o", "n_words": 3, "prompt_id": 7, "my_prompt": "x",
           "system_prompt_v2": "y",
           # an earlier job's answer columns, relay's own names
           "text": "old", "finish_reason": "stop", "completion_tokens": 4, "row_index": 0}
    got = parse_request({"id": "a", "prompt": "Hi", "max_tokens": 5, **own}, 0)
    assert isinstance(got, RequestRow) and got == plain


def test_a_near_miss_inside_an_openai_body_is_an_error_row():
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}], "max_token": 5, "user": "u"}
    got = parse_request({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body}, 2)
    assert got.error.startswith("row 2 (id \"c1\"): unknown field 'max_token'; did you mean 'max_tokens'?")
    del body["max_token"]
    assert isinstance(parse_request({"custom_id": "c1", "body": body}, 2), RequestRow)


def test_a_near_miss_row_in_a_file_is_an_error_row_and_the_job_goes_on(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "unk", "prompt": "Hi", "max_token": 5}\n{"id": "ok", "prompt": "Hi", "label": "a"}\n')
    rows = list(read_requests(open_requests(path)))
    assert rows[0].error.startswith("row 0 (line 1, id \"unk\"): unknown field 'max_token'; did you mean 'max_tokens'?")
    assert isinstance(rows[1], RequestRow) and rows[1].id == "ok"


# -- range hints fit the value --------------------------------------------------------------

@pytest.mark.parametrize("n, hint", [(0, "set it from 1 to 16"), (-3, "set it from 1 to 16"),
                                     (2.5, "set it from 1 to 16"), (17, "lower it")])
def test_the_n_hint_fits_the_value(n, hint):
    got = parse_request({"prompt": "Hi", "n": n}, 0)
    assert got.error.startswith(f"row 0: 'n' must be an integer from 1 to 16, got {n}; {hint}")
    assert ("lower it" in got.error) == (n == 17)


# -- LF, CRLF and CR line endings, mixed in one file --------------------------------------

MIXED = (b'{"id": "x", "prompt": "Hi"}\r\n'
         b'{"id": "y", "prompt": "Hi there"}\r'
         b'{"id": "z", "prompt": "Yo"}\n'
         b'\r'
         b'{"id": "w", "prompt": ""}\r\n')


def test_mixed_line_endings_are_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(MIXED)
    src = open_requests(path)
    rows = list(read_requests(src))
    assert src.num_rows == 4 and [r.id for r in rows] == ["x", "y", "z", "w"]
    assert all(isinstance(r, RequestRow) for r in rows[:3])
    assert rows[3].error.startswith("row 3 (line 5, id \"w\"): 'prompt' is empty")  # CR, CRLF, CR, LF, CR


def test_spans_of_a_mixed_file_read_its_rows(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(MIXED * 50)  # enough rows for several spans, which start only after an LF
    src = open_requests(path)
    whole = list(src)
    assert len(whole) == src.num_rows == 200 and len(src.spans()) > 1
    assert [row for span in src.spans() for row in read_span(span)] == whole


def test_a_cr_inside_one_json_object_stays_whitespace(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"prompt": "a",\r"max_tokens": 3}\n\r{"prompt": "b"}\n')
    assert [raw for _, raw, _ in open_requests(path)] == [{"prompt": "a", "max_tokens": 3}, {"prompt": "b"}]


# -- refusals name the option or command that fixes them ----------------------------------

def test_an_unknown_extension_names_the_format_option(tmp_path):
    with pytest.raises(InputError, match=r"r2.txt .*; name it .jsonl or .parquet, or pass --format jsonl or "
                                         r"--format parquet$"):
        detect_format(tmp_path / "r2.txt")


@pytest.mark.parametrize("text", ["hi\n", "You are a helpful assistant who answers briefly.\n"])
def test_a_text_file_given_as_an_artifact_names_compile_prompt(tmp_path, text):
    sys_txt = tmp_path / "sys.txt"
    sys_txt.write_text(text)
    with pytest.raises(ArtifactError) as e:
        read_artifact(sys_txt)
    assert str(e.value).startswith(f"{sys_txt}: not a .relaykv artifact (")
    assert str(e.value).endswith(f"compile it first (relay compile-prompt {sys_txt}) and use {tmp_path}/sys.relaykv")
    damaged = tmp_path / "sys.relaykv"
    damaged.write_text(text)
    with pytest.raises(ArtifactError, match=f"recompile it from its system prompt: relay compile-prompt SYS_TXT "
                                            f"--out {damaged}$"):
        read_artifact(damaged)


JOB = {"input_sha256": "a" * 64, "model_fingerprint": "m1", "dtype": "float32", "prompts": [["sys", "c1"]],
       "defaults": dataclasses.asdict(RequestDefaults())}


def _refusal(job: dict, stored: dict = JOB) -> str:
    return str(another_job("OUT holds the answers", job, stored, "remove it", "start over"))


def test_a_resume_refusal_names_what_changed_with_both_values():
    changed = {**JOB, "defaults": {**JOB["defaults"], "temperature": 0.5, "max_tokens": 9}}
    assert _refusal(changed) == ("OUT holds the answers of another job, run with --max-tokens 256 (now 9) and "
                                 "--temperature 1.0 (now 0.5); remove it")
    other = {**JOB, "model_fingerprint": "m2", "dtype": "bfloat16", "prompts": []}
    assert _refusal(other) == ("OUT holds the answers of another job, run with --dtype float32 (now "
                               "bfloat16), another model and other --prompt artifacts; remove it")
    assert _refusal({**changed, "input_sha256": "b" * 64}) == (
        "OUT holds the answers of another job: the input file changed since those answers were saved, and that "
        "job ran with --max-tokens 256 (now 9) and --temperature 1.0 (now 0.5); put the original input back to "
        "resume, or start over")
    assert _refusal(JOB, {"input_sha256": "a" * 64, "dtype": "float32"}) == (
        "OUT holds the answers of another job (its job record lacks defaults, model_fingerprint, prompts); remove it")
    assert _refusal(JOB, {}) == "OUT holds the answers of another job (its job record cannot be read); remove it"


# -- through `relay run` ------------------------------------------------------------------

def test_relay_run_names_lines_ids_and_changed_options(tmp_path):
    src, out = tmp_path / "r.jsonl", tmp_path / "o.parquet"
    src.write_bytes(b'{"id": "a", "prompt": "Hi"}\r\n\n{"id": "unk", "prompt": "Hi", "max_token": 5}\r'
                    b'{"id": "b", "prompt": "Hi", "label": "kept out of the answer"}\n{"prompt": "Hi", "n": 0}\n'
                    b'{"id": "re", "prompt": "Hi", "regex": "(unclosed"}\n')
    args = ["run", "--in", src, "--out", out, "--model", "dummy:tiny", "--device", "cpu", "--max-tokens", "2",
            "--quiet"]
    res = relay(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = pq.read_table(out).to_pylist()
    assert [(r["id"], r["finish_reason"] == "error") for r in rows] == [("a", False), ("unk", True), ("b", False),
                                                                        ("3", True), ("re", True)]
    assert rows[1]["error"].startswith("row 1 (line 3, id \"unk\"): unknown field 'max_token'; did you mean "
                                       "'max_tokens'?")
    assert rows[3]["error"].startswith("row 3 (line 5): 'n' must be an integer from 1 to 16, got 0; set it from 1 "
                                       "to 16")
    assert rows[4]["error"].startswith("row 4 (line 6, id \"re\"): ")  # made by the engine, named as the reader does
    res = relay(*args, "--resume", "--temperature", "0.5")
    assert res.returncode == 2 and "--temperature 1.0 (now 0.5)" in res.stderr, res.stderr
    res = relay("run", "--in", tmp_path / "r2.txt", "--out", tmp_path / "o2.jsonl")
    assert res.returncode == 2 and "or pass --format jsonl or --format parquet" in res.stderr, res.stderr

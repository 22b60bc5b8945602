"""Streaming readers: JSONL and Parquet rows, nested columns, nulls, malformed and blank lines."""

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relaycli.io.reader import InputError, detect_format, open_requests, read_requests
from relaycli.io.requests import RequestDefaults, RequestRow, ResultRow


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_jsonl_rows_blank_lines_and_malformed_lines(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [
        json.dumps({"id": "a", "prompt": "hi"}),
        "",
        "   \t",
        '{"prompt": "broken"',
        json.dumps([1, 2]),
        json.dumps({"messages": [{"role": "user", "content": "héllo ✓"}]}),
    ])
    src = open_requests(path)
    assert src.fmt == "jsonl" and src.num_rows == 4 and len(src) == 4
    rows = list(src)
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert rows[0] == (0, {"id": "a", "prompt": "hi"}, None)
    assert rows[1][1] is None and rows[1][2].startswith("row 1 (line 4): not valid JSON")
    assert rows[2][1] is None and "holds a JSON array, not an object" in rows[2][2]
    assert rows[3][1]["messages"][0]["content"] == "héllo ✓"


def test_jsonl_bom_crlf_and_no_final_newline(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n{"prompt": "b"}')
    src = open_requests(path)
    assert src.num_rows == 2
    assert [raw["prompt"] for _, raw, _ in src] == ["a", "b"]


def test_jsonl_bom_then_blank_first_line_is_no_row(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'\xef\xbb\xbf\n{"prompt": "a"}\n')
    src = open_requests(path)
    assert src.num_rows == 1
    assert list(src) == [(0, {"prompt": "a"}, None)]


def test_jsonl_cr_only_line_endings_are_lines(tmp_path):
    # Old Mac line endings: three requests, not one unparsable row; line numbers count CRs.
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r{"prompt": "b"}\r\rnot json\r')
    src = open_requests(path)
    assert src.num_rows == 3
    rows = list(src)
    assert [raw["prompt"] for _, raw, _ in rows[:2]] == ["a", "b"]
    assert rows[2][1] is None and rows[2][2].startswith("row 2 (line 4): not valid JSON")


def test_a_cr_inside_an_lf_line_is_json_whitespace(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"prompt": "a",\r"max_tokens": 3}\n{"prompt": "b"}\r\n')
    src = open_requests(path)
    assert src.num_rows == 2
    assert [raw for _, raw, _ in src] == [{"prompt": "a", "max_tokens": 3}, {"prompt": "b"}]


def test_zero_filled_start_is_not_taken_for_utf16(tmp_path):
    # A crash can leave a run of zeros; they are error rows, not a refused file.
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\x00" * 3000 + b'\n{"prompt": "ok"}\n')
    rows = list(open_requests(path))
    assert rows[-1] == (1, {"prompt": "ok"}, None) and rows[0][1] is None


def test_utf16_and_utf32_files_are_refused_not_split_into_invented_rows(tmp_path):
    text = '{"id": "a", "prompt": "Hi"}\n{"id": "b", "prompt": "Hi"}\n'
    for encoding in ("utf-16", "utf-16-le", "utf-32"):
        path = tmp_path / f"{encoding}.jsonl"
        path.write_bytes(text.encode(encoding))
        with pytest.raises(InputError, match="UTF-16 or UTF-32 text; relay reads UTF-8"):
            open_requests(path)


def test_parquet_bytes_given_as_jsonl_are_refused(tmp_path):
    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), path)
    with pytest.raises(InputError, match="is a Parquet file, not JSON Lines"):
        open_requests(path, "jsonl")


def test_json_nested_too_deeply_is_that_rows_error(tmp_path):
    path = tmp_path / "r.jsonl"
    deep = '{"prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path.write_text(deep + "\n" + '{"prompt": "ok"}\n')
    rows = list(read_requests(open_requests(path)))
    assert rows[0].finish_reason == "error" and "nested too deeply" in rows[0].error
    assert rows[1].messages == [{"role": "user", "content": "ok"}]
    # Nested just under what the reader takes: parsed, then refused with a short message.
    path.write_text('{"prompt": ' + "[" * 900 + "]" * 900 + "}\n")
    row, = read_requests(open_requests(path))
    assert row.finish_reason == "error" and "'prompt' must be a string" in row.error and len(row.error) < 200


def test_jsonl_invalid_utf8_is_a_row_error(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"prompt": "\xff\xfe"}\n{"prompt": "ok"}\n')
    rows = list(open_requests(path))
    assert rows[0][1] is None and "UTF-8" in rows[0][2]
    assert rows[1][1] == {"prompt": "ok"}


def test_pretty_printed_json_refused(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps([{"prompt": "a"}], indent=2))
    with pytest.raises(InputError, match="JSON Lines"):
        open_requests(path)


def test_read_requests_turns_errors_into_rows_and_skips_done(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [
        json.dumps({"prompt": "a"}), "not json", json.dumps({"prompt": ""}), json.dumps({"prompt": "d"})])
    out = list(read_requests(open_requests(path), RequestDefaults(max_tokens=9)))
    assert [type(r) for r in out] == [RequestRow, ResultRow, ResultRow, RequestRow]
    assert out[0].sampling.max_tokens == 9
    assert out[1].error.startswith("row 1 (line 2): not valid JSON") and out[1].id == "1"
    assert "'prompt' is empty" in out[2].error
    skipped = list(read_requests(open_requests(path), skip={0, 1}))
    assert [r.row_index for r in skipped] == [2, 3]


def test_parquet_nested_columns_and_nulls(tmp_path):
    msg = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    table = pa.table({
        "id": ["a", None, "c"],
        "prompt": [None, "plain question", None],
        "messages": pa.array([
            [{"role": "system", "content": "Be brief.", "name": None},
             {"role": "user", "content": "Hi", "name": None}],
            None,
            [{"role": "user", "content": "Stop at X", "name": "bob"}]], type=pa.list_(msg)),
        "stop": pa.array([None, ["\n", "END"], []], type=pa.list_(pa.string())),
        "max_tokens": pa.array([16, None, 4], type=pa.int64()),
        "temperature": pa.array([None, 0.0, None], type=pa.float64()),
    })
    path = tmp_path / "r.parquet"
    pq.write_table(table, path, row_group_size=2)  # two row groups: the batches must join up
    src = open_requests(path)
    assert src.fmt == "parquet" and src.num_rows == 3
    raws = list(src)
    assert [i for i, _, _ in raws] == [0, 1, 2] and all(e is None for _, _, e in raws)
    assert "prompt" not in raws[0][1] and "id" not in raws[1][1]  # nulls are absent
    rows = list(read_requests(open_requests(path), RequestDefaults(max_tokens=100)))
    assert all(isinstance(r, RequestRow) for r in rows), rows
    assert rows[0].id == "a" and rows[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert rows[0].sampling.max_tokens == 16 and rows[0].sampling.stop == []
    assert rows[1].id == "1" and rows[1].messages == [{"role": "user", "content": "plain question"}]
    assert rows[1].sampling.stop == ["\n", "END"] and rows[1].sampling.temperature == 0.0
    assert rows[1].sampling.max_tokens == 100
    assert rows[2].messages == [{"role": "user", "content": "Stop at X"}]


def test_parquet_streams_in_batches(tmp_path):
    n = 5000
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(n)]}), path, row_group_size=700)
    src = open_requests(path)
    assert src.num_rows == n
    seen = 0
    for i, raw, err in src:
        assert raw == {"prompt": f"q{i}"} and err is None
        seen += 1
    assert seen == n


def test_a_damaged_parquet_row_group_costs_only_its_own_rows(tmp_path):
    """Rows of a row group whose pages cannot be decoded become error rows naming the
    group and its rows; the groups before and after it are read as usual, and every row
    of the file comes out once, in order."""
    n, per = 12, 4
    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"prompt": [f"question number {i} " * 4 for i in range(n)]}), path,
                   row_group_size=per, compression="none")
    damaged = random.choice([1, 2])  # not the first: the first rows must still read
    column = pq.ParquetFile(path).metadata.row_group(damaged).column(0)
    data = bytearray(path.read_bytes())
    for i in range(column.data_page_offset + 1, column.data_page_offset + 120):  # the page header and data
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    src = open_requests(path)
    assert src.num_rows == n
    raws = list(src)
    assert [i for i, _, _ in raws] == list(range(n))
    lost = range(damaged * per, (damaged + 1) * per)
    for i, raw, err in raws:
        if i in lost:
            assert raw is None and err.startswith(f"row {i}: Parquet row group {damaged + 1} of 3 "
                                                  f"(rows {lost[0]}-{lost[-1]}) could not be read"), err
            assert "rewrite the file" in err and "\n" not in err
        else:
            assert err is None and raw == {"prompt": f"question number {i} " * 4}
    rows = list(read_requests(open_requests(path)))
    assert len(rows) == n and [isinstance(r, RequestRow) for r in rows] == [i not in lost for i in range(n)]


def test_format_override_and_detection(tmp_path):
    path = write_lines(tmp_path / "requests.txt", [json.dumps({"prompt": "a"})])
    with pytest.raises(InputError, match="extension"):
        open_requests(path)
    assert open_requests(path, "jsonl").num_rows == 1
    assert detect_format("x.PARQUET") == "parquet" and detect_format("x.json") == "jsonl"
    assert detect_format("x.ndjson") == "jsonl"
    with pytest.raises(InputError, match="unknown input format"):
        detect_format("x.jsonl", "csv")


def test_missing_file_directory_and_bad_parquet(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        open_requests(tmp_path / "nope.jsonl")
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(InputError, match="is not a file"):
        open_requests(tmp_path / "d.jsonl")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        open_requests(junk)
    # A message is one sentence, one line.
    try:
        open_requests(junk)
    except InputError as e:
        assert "\n" not in str(e)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_examples_parse_cleanly_and_parquet_matches_jsonl():
    jsonl = list(read_requests(open_requests(EXAMPLES / "requests.jsonl")))
    parquet = list(read_requests(open_requests(EXAMPLES / "requests.parquet")))
    assert len(jsonl) == 120 and all(isinstance(r, RequestRow) for r in jsonl)
    assert parquet == jsonl  # same rows, same sampling, same derived seeds
    assert len({r.id for r in jsonl}) == 120
    assert any(len(r.messages) > 2 for r in jsonl) and any(r.sampling.stop for r in jsonl)
    batch = list(read_requests(open_requests(EXAMPLES / "openai_batch.jsonl")))
    assert len(batch) >= 15 and all(isinstance(r, RequestRow) and r.is_openai for r in batch)
    assert {r.url for r in batch} == {"/v1/chat/completions", "/v1/completions"}
    assert len((EXAMPLES / "system_prompt.txt").read_text(encoding="utf-8")) >= 5000


def test_content_sha256_is_the_files_for_both_formats(tmp_path):
    import hashlib
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\n{"prompt": "b"}')  # BOM, CRLF, no final LF
    parquet = tmp_path / "r.parquet"
    pq.write_table(pa.table({"prompt": ["a"]}), parquet)
    for path in (jsonl, parquet):
        assert open_requests(path).content_sha256() == hashlib.sha256(path.read_bytes()).hexdigest()

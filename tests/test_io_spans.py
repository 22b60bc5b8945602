"""Spans: an input read in pieces (as Ray's read tasks do) gives exactly the rows of one reading."""

import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relaycli.io import reader
from relaycli.io.reader import InputError, Span, join_spans, open_requests, read_span

LINES = [
    b'\xef\xbb\xbf{"id": "a", "prompt": "h\xc3\xa9llo \xe2\x9c\x93"}\r\n',
    b"\n",
    b'{"prompt": "broken"\n',
    b"   \t\r\n",
    b"[1, 2]\n",
    b'{"prompt": "\xf0\x9f\x99\x82 smile"}\r\n',
    b'{"prompt": "bad \xff byte"}\n',
    b"\r\n",
    b'{"messages": [{"role": "user", "content": "\xe6\x97\xa5\xe6\x9c\xac"}]}\n',
    b"\n",
    b"\n",
    b'{"prompt": "x"}\n',
    b"42\n",
    b'{"prompt": "last, no newline"}',
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(LINES))
    return path


def _read_all(spans):
    return [row for span in spans for row in read_span(span)]


def test_jsonl_spans_cut_at_every_row_read_as_the_whole_file(jsonl, monkeypatch):
    monkeypatch.setattr(reader, "_SPLIT_ROWS", 1)
    source = open_requests(jsonl)
    whole = list(source)
    spans = source.spans()
    assert len(spans) == source.num_rows == 9 and sum(s.num_rows for s in spans) == 9
    assert _read_all(spans) == whole
    assert [e for _, _, e in whole if e] == [  # the errors name the file's own row and line numbers
        "row 1 (line 3): not valid JSON (Expecting ',' delimiter at column 20); write one JSON object per line",
        "row 2 (line 5): holds a JSON array, not an object; write one object with 'prompt' or 'messages' per line",
        "row 4 (line 7): not valid UTF-8; save the file as UTF-8",
        "row 7 (line 13): holds a JSON number, not an object; write one object with 'prompt' or 'messages' per line"]
    rng = random.Random(0)
    for _ in range(20):  # spans joined into larger read tasks
        cuts = sorted(rng.sample(range(1, len(spans)), rng.randint(0, len(spans) - 1)))
        groups = [spans[a:b] for a, b in zip([0, *cuts], [*cuts, len(spans)])]
        assert _read_all([join_spans(g) for g in groups]) == whole


def test_jsonl_a_cut_at_any_line_start_reads_as_the_whole_file(jsonl):
    source = open_requests(jsonl)
    whole, data = list(source), jsonl.read_bytes()
    pin = (len(data), os.stat(jsonl).st_mtime_ns)
    offset, rows = 0, 0
    for line_no, line in enumerate(LINES[:-1], start=1):  # a cut after each line: blank, CRLF, bad bytes...
        offset += len(line)
        rows += bool(line.removeprefix(b"\xef\xbb\xbf").strip())
        head = Span(jsonl, "jsonl", 0, offset, 0, rows, 0, pin)
        tail = Span(jsonl, "jsonl", offset, len(data), rows, source.num_rows - rows, line_no, pin)
        assert _read_all([head, tail]) == whole, line_no


def test_jsonl_split_points_thin_out_for_large_files(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "_SPLIT_ROWS", 2)
    monkeypatch.setattr(reader, "_MAX_SPLITS", 4)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + ("\n\n" if i % 3 else "\n") for i in range(50)))
    source = open_requests(path)
    spans = source.spans()
    assert 2 <= len(spans) <= 5 and len({s.num_rows for s in spans[:-1]}) == 1  # equal spans, the last one the rest
    assert _read_all(spans) == list(source)


def test_jsonl_with_old_mac_line_endings_is_one_span(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "_SPLIT_ROWS", 1)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r{"prompt": "b"}\r\rnot json\r')
    source = open_requests(path)
    assert len(source.spans()) == 1 and _read_all(source.spans()) == list(source)


def test_a_span_of_a_changed_file_is_refused(jsonl, monkeypatch):
    monkeypatch.setattr(reader, "_SPLIT_ROWS", 1)
    spans = open_requests(jsonl).spans()
    with open(jsonl, "ab") as f:
        f.write(b'\n{"prompt": "appended"}\n')
    with pytest.raises(InputError, match="changed while the job ran"):
        list(read_span(spans[3]))


def test_parquet_spans_are_row_groups_read_as_the_whole_file(tmp_path):
    path = tmp_path / "in.parquet"
    rows = [{"id": f"r{i}", "prompt": None if i % 5 == 0 else f"p{i}",
             "messages": [{"role": "user", "content": f"m{i}"}] if i % 5 == 0 else None} for i in range(23)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    source = open_requests(path)
    whole, spans = list(source), source.spans()
    assert len(spans) == 6 and [s.first_row for s in spans] == [0, 4, 8, 12, 16, 20]
    assert _read_all(spans) == whole and whole[5] == (5, {"id": "r5", "messages": [{"role": "user",
                                                                                   "content": "m5"}]}, None)
    assert _read_all([join_spans(spans[:2]), join_spans(spans[2:5]), spans[5]]) == whole

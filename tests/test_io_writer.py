"""ResultWriter: ordered output from out-of-order results, atomic parts, crash and resume."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import relaycli.io.parts as parts_mod
import relaycli.io.writer as writer_mod
from relaycli.io.requests import ResultRow
from relaycli.io.writer import OUTPUT_COLUMNS, OutputError, ResultWriter

REPO = Path(__file__).resolve().parents[1]


def result(i: int, url=None) -> ResultRow:
    if i % 10 == 9:
        return ResultRow.failed(i, f"id{i}", f"row {i}: something was wrong", url=url)
    return ResultRow(i, f"id{i}", f"answer {i} ✓", "length" if i % 3 else "stop",
                     prompt_tokens=20 + i, cached_tokens=10, completion_tokens=i % 5, url=url)


def read_out(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def parts(out: Path) -> list[Path]:
    folder = out.with_name(out.name + ".parts")
    return sorted(folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("name", ["out.parquet", "out.jsonl"])
def test_out_of_order_writes_come_out_in_order(tmp_path, name):
    out = tmp_path / name
    order = list(range(50))
    random.Random(1).shuffle(order)
    with ResultWriter(out, flush_rows=7) as w:
        for i in order:
            w.write(result(i))
        assert len(parts(out)) == 50 // 7  # full buffers went to disk as parts
        w.finalize(50)
    rows = read_out(out)
    assert [r["id"] for r in rows] == [f"id{i}" for i in range(50)]
    assert list(rows[0]) == list(OUTPUT_COLUMNS)
    assert rows[1] == {"id": "id1", "text": "answer 1 ✓", "finish_reason": "length", "prompt_tokens": 21,
                       "cached_tokens": 10, "completion_tokens": 1, "error": None, "logprobs": None,
                       "completions": None}
    assert rows[9]["finish_reason"] == "error" and rows[9]["error"] == "row 9: something was wrong"
    assert not out.with_name(out.name + ".parts").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temp files left behind


def test_parquet_schema_is_fixed(tmp_path):
    out = tmp_path / "o.parquet"
    with ResultWriter(out) as w:
        w.write(result(0))
        w.finalize(1)
    schema = pq.read_schema(out)
    assert schema.names == list(OUTPUT_COLUMNS)
    assert [str(f.type) for f in schema][:7] == ["string"] * 3 + ["int64"] * 3 + ["string"]
    assert schema.field("error").nullable
    assert schema.field("logprobs").nullable and schema.field("completions").nullable


def test_openai_output_lines(tmp_path):
    out = tmp_path / "o.jsonl"
    with ResultWriter(out, openai_output=True, model_name="smollm2") as w:
        w.write(result(1, url="/v1/completions"))
        w.write(result(0, url="/v1/chat/completions"))
        w.write(result(9, url="/v1/chat/completions"))
        for i in range(2, 9):
            w.write(result(i))
        w.finalize(10)
    lines = read_out(out)
    chat, text, err = lines[0], lines[1], lines[9]
    assert chat["custom_id"] == "id0" and chat["id"].startswith("batch_req_") and chat["error"] is None
    body = chat["response"]["body"]
    assert chat["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["model"] == "smollm2"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "answer 0 ✓"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 0, "total_tokens": 20,
                             "prompt_tokens_details": {"cached_tokens": 10}}
    tbody = text["response"]["body"]
    assert tbody["object"] == "text_completion" and tbody["choices"][0]["text"] == "answer 1 ✓"
    assert tbody["usage"]["total_tokens"] == 21 + 1
    assert err["response"] is None and err["error"]["message"] == "row 9: something was wrong"
    assert err["error"]["code"]
    assert len({line["id"] for line in lines}) == 10


def test_openai_output_ignored_for_parquet(tmp_path):
    out = tmp_path / "o.parquet"
    with ResultWriter(out, openai_output=True) as w:
        w.write(result(0))
        w.finalize(1)
    assert pq.read_schema(out).names == list(OUTPUT_COLUMNS)


def test_existing_output_or_parts_needs_resume(tmp_path):
    out = tmp_path / "o.parquet"
    out.write_bytes(b"old")
    with pytest.raises(OutputError, match="pass --resume to continue that job or remove it"):
        ResultWriter(out)
    out.unlink()
    (tmp_path / "o.parquet.parts").mkdir()
    with pytest.raises(OutputError, match="--resume"):
        ResultWriter(out)


def test_bad_output_path_fails_at_construction(tmp_path):
    with pytest.raises(OutputError, match="does not exist"):
        ResultWriter(tmp_path / "missing" / "o.parquet")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="does not exist"):
        ResultWriter(tmp_path / "file" / "o.parquet")
    (tmp_path / "dir.parquet").mkdir()
    with pytest.raises(OutputError, match="is a folder"):
        ResultWriter(tmp_path / "dir.parquet")
    with pytest.raises(OutputError, match="extension"):
        ResultWriter(tmp_path / "o.csv")
    if os.geteuid() != 0:  # root writes anywhere, so only a normal user can see this one
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OutputError, match="cannot write"):
            ResultWriter(locked / "o.parquet")


def test_finalize_refuses_missing_or_foreign_rows(tmp_path):
    out = tmp_path / "o.parquet"
    w = ResultWriter(out)
    for i in (0, 1, 3):
        w.write(result(i))
    with pytest.raises(OutputError, match="row 2 has no result"):
        w.finalize(4)
    assert not out.exists() and parts(out)  # nothing lost: the parts are still there
    w.close()  # the failed job ends, and with it its lock on OUT
    w2 = ResultWriter(out, resume=True)
    assert w2.done_row_indices() == {0, 1, 3}
    with pytest.raises(OutputError, match="another job"):
        w2.finalize(2)
    w2.write(result(2))
    with pytest.raises(OutputError, match="row 4 has no result"):
        w2.finalize(5)
    w2.finalize(4)
    assert [r["id"] for r in read_out(out)] == ["id0", "id1", "id2", "id3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.parquet"]


def test_duplicate_write_rejected(tmp_path):
    w = ResultWriter(tmp_path / "o.parquet")
    w.write(result(0))
    with pytest.raises(ValueError, match="already has a result"):
        w.write(result(0))


def test_flush_by_time_and_on_exception(tmp_path):
    out = tmp_path / "o.jsonl"
    w = ResultWriter(out, flush_rows=1000, flush_seconds=0.05)
    w.write(result(0))
    assert parts(out) == []
    time.sleep(0.06)
    w.write(result(1))
    assert len(parts(out)) == 1
    with pytest.raises(RuntimeError):
        with ResultWriter(tmp_path / "b.jsonl", flush_rows=1000) as w2:
            w2.write(result(0))
            raise RuntimeError("engine died")
    assert ResultWriter(tmp_path / "b.jsonl", resume=True).done_row_indices() == {0}


def test_resume_after_abandoned_writer_and_stray_temp_file(tmp_path):
    out = tmp_path / "o.parquet"
    w = ResultWriter(out, flush_rows=1000)
    flushed = [5, 2, 8, 0, 11]
    for i in flushed:
        w.write(result(i))
    w.flush()
    for i in (1, 3):  # buffered, never flushed: lost in the "crash"
        w.write(result(i))
    del w  # abandoned without close or finalize, as SIGKILL would leave it
    folder = out.with_name("o.parquet.parts")
    # A part killed between write and rename: whole on disk, but never done.
    stray = parts_mod.rows_table([vars(result(1)), vars(result(3))])
    pq.write_table(stray, folder / ".tmp-part-999.parquet")
    (tmp_path / ".tmp-o.parquet").write_bytes(b"half an output")
    w = ResultWriter(out, resume=True)
    assert w.done_row_indices() == set(flushed) and w.dropped_parts == []
    assert not (folder / ".tmp-part-999.parquet").exists() and not (tmp_path / ".tmp-o.parquet").exists()
    for i in range(12):
        if i not in w.done_row_indices():
            w.write(result(i))
    w.finalize(12)
    assert [r["id"] for r in read_out(out)] == [f"id{i}" for i in range(12)]


def test_duplicate_parts_keep_one_and_corrupt_part_dropped(tmp_path):
    out = tmp_path / "o.jsonl"
    w = ResultWriter(out, flush_rows=3)
    for i in range(6):
        w.write(result(i))
    first, second = parts(out)
    shutil.copy(first, first.with_name("part-copy.parquet"))  # a crash mid-merge leaves such twins
    bad = first.with_name("part-zzz.parquet")
    bad.write_bytes(b"not parquet")
    del w  # abandoned, as a crash leaves it (its lock dies with it)
    w = ResultWriter(out, resume=True)
    assert w.done_row_indices() == set(range(6)) and w.dropped_parts == [bad] and not bad.exists()
    w.finalize(6)
    assert [r["id"] for r in read_out(out)] == [f"id{i}" for i in range(6)]


def test_part_with_bytes_that_are_not_utf8_is_dropped_on_resume(tmp_path):
    # A bit flip inside a string column: Parquet reads the row index fine, the merge would not.
    import pyarrow as pa
    out = tmp_path / "o.jsonl"
    w = ResultWriter(out, flush_rows=2)
    for i in range(4):
        w.write(result(i))
    del w
    victim = parts(out)[0]
    table = pq.read_table(victim)
    texts = table.column("text").combine_chunks()
    data = bytearray(texts.buffers()[2].to_pybytes())
    data[0] = 0xFF
    broken = pa.Array.from_buffers(pa.string(), len(texts),
                                   [texts.buffers()[0], texts.buffers()[1], pa.py_buffer(bytes(data))])
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", broken), victim)
    w = ResultWriter(out, resume=True)
    assert w.dropped_parts == [victim] and w.done_row_indices() == {2, 3}
    for i in (0, 1):
        w.write(result(i))
    w.finalize(4)
    assert [r["text"] for r in read_out(out)] == [result(i).text for i in range(4)]


def test_second_writer_on_the_same_output_is_refused(tmp_path):
    out = tmp_path / "o.parquet"
    w = ResultWriter(out)
    with pytest.raises(OutputError, match="another relay job is writing"):
        ResultWriter(out, resume=True)
    code = ("import sys; from relaycli.io.writer import ResultWriter, OutputError\n"
            "try:\n    ResultWriter(sys.argv[1], resume=True)\nexcept OutputError as e:\n    print(e)\n")
    child = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "another relay job is writing" in child.stdout
    w.write(result(0))
    w.finalize(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.parquet"]  # no lock file left
    assert ResultWriter(out, resume=True).already_complete


def test_many_parts_merge_in_rounds(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod, "_FAN_IN", 3)
    out = tmp_path / "o.parquet"
    order = list(range(40))
    random.Random(2).shuffle(order)
    with ResultWriter(out, flush_rows=2) as w:
        for i in order:
            w.write(result(i))
        w.finalize(40)
    assert [r["id"] for r in read_out(out)] == [f"id{i}" for i in range(40)]


def test_complete_output_means_nothing_to_do(tmp_path):
    out = tmp_path / "o.jsonl"
    with ResultWriter(out) as w:
        for i in range(3):
            w.write(result(i))
        w.finalize(3)
    before = out.read_bytes()
    w = ResultWriter(out, resume=True)
    assert w.already_complete
    with pytest.raises(OutputError, match="holds 3 rows but the input has 4"):
        w.finalize(4)
    w.finalize(3)
    assert out.read_bytes() == before


@pytest.mark.parametrize("name", ["o.parquet", "o.jsonl"])
def test_resumed_complete_output_is_checked_row_by_row(tmp_path, name):
    out = tmp_path / name
    job = {"input_sha256": "a" * 64, "defaults": {"max_tokens": 8}}
    with ResultWriter(out) as w:
        w.bind_job(job, 20, iter(()))
        for i in range(20):
            w.write(result(i))
        w.finalize(20)
    ids = [f"id{i}" for i in range(20)]

    w = ResultWriter(out, resume=True)
    w.bind_job(job, 20, iter(ids))
    assert w.already_complete and w.error_rows == 2  # rows 9 and 19
    w.close()
    with pytest.raises(OutputError, match="row 3 .* is not row 3 of the input"):
        ResultWriter(out, resume=True).bind_job(job, 20, iter(ids[:3] + ["other"] + ids[4:]))
    if name.endswith(".parquet"):  # the job record is kept in the Parquet metadata
        with pytest.raises(OutputError, match="another job: the input file changed since those answers were saved"):
            ResultWriter(out, resume=True).bind_job({**job, "input_sha256": "b" * 64}, 20, iter(ids))
    # A finished output that was cut short afterwards is not complete.
    if name.endswith(".jsonl"):
        out.write_text("".join(out.read_text().splitlines(keepends=True)[:12]))
    else:
        pq.write_table(pq.read_table(out).slice(0, 12), out)
    with pytest.raises(OutputError, match="holds 12 rows but the input has 20: it was cut short"):
        ResultWriter(out, resume=True).bind_job(job, 20, iter(ids))


def test_resumed_parts_of_another_job_are_refused(tmp_path):
    out = tmp_path / "o.parquet"
    job = {"input_sha256": "a" * 64, "model_fingerprint": "m"}
    w = ResultWriter(out, flush_rows=2)
    w.bind_job(job, 10, iter(()))
    for i in range(4):
        w.write(result(i))
    w.close()  # an interrupted job: two parts and the record
    with pytest.raises(OutputError, match="another job: the input file changed since those answers were saved"):
        ResultWriter(out, resume=True).bind_job({**job, "input_sha256": "b" * 64}, 10, iter(()))
    w = ResultWriter(out, resume=True)
    w.bind_job(job, 10, iter(()))
    assert w.done_row_indices() == {0, 1, 2, 3}
    for i in range(4, 10):
        w.write(result(i))
    w.finalize(10)
    assert w.error_rows == 1 and [r["id"] for r in read_out(out)] == [f"id{i}" for i in range(10)]


def test_parts_without_a_job_record_are_refused_when_the_job_is_known(tmp_path):
    out = tmp_path / "o.parquet"
    w = ResultWriter(out, flush_rows=1)  # no bind_job: what an older relay left
    w.write(result(0))
    w.close()
    with pytest.raises(OutputError, match="no job record"):
        ResultWriter(out, resume=True).bind_job({"input_sha256": "a"}, 3, iter(()))


def test_a_job_record_that_is_no_object_is_another_jobs(tmp_path):
    out = tmp_path / "o.parquet"
    w = ResultWriter(out, flush_rows=1)
    w.bind_job({"input_sha256": "a"}, 2, iter(()))
    w.write(result(0))
    w.close()
    (Path(str(out) + ".parts") / "job.json").write_text("[]")
    with pytest.raises(OutputError, match="holds answers of another job"):
        ResultWriter(out, resume=True).bind_job({"input_sha256": "a"}, 2, iter(()))


def test_no_lock_file_after_a_resume_finds_the_job_complete(tmp_path):
    out = tmp_path / "o.jsonl"
    with ResultWriter(out) as w:
        w.write(result(0))
        w.finalize(1)
    with ResultWriter(out, resume=True) as w:
        w.bind_job({"input_sha256": "a"}, 1, iter(["id0"]))
        assert w.already_complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]


def test_lock_file_is_removed_when_a_run_is_refused(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text("")
    with pytest.raises(OutputError, match="already exists"):
        ResultWriter(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]


def test_empty_job(tmp_path):
    with ResultWriter(tmp_path / "o.parquet") as w:
        w.finalize(0)
    assert pq.read_table(tmp_path / "o.parquet").num_rows == 0


CHILD = textwrap.dedent("""
    import random, sys, time
    from relaycli.io.requests import ResultRow
    from relaycli.io.writer import ResultWriter
    out, n = sys.argv[1], int(sys.argv[2])
    w = ResultWriter(out, resume=True, flush_rows=5)
    todo = [i for i in range(n) if i not in w.done_row_indices()]
    random.shuffle(todo)
    print("ready", flush=True)
    for i in todo:
        w.write(ResultRow(i, f"id{i}", f"text {i} " + "x" * (i % 50), "stop", 10, 3, i % 7))
        time.sleep(0.001)
    w.finalize(n)
""")


def test_sigkill_at_random_moment_then_resume(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out, n = tmp_path / "o.parquet", 800
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rng = random.Random()
    killed_at = []
    for _ in range(2):  # two crashes, the second one during a resumed run
        proc = subprocess.Popen([sys.executable, str(script), str(out), str(n)], env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        delay = rng.uniform(0.02, 0.4)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, f"child finished before the kill at {delay:.3f}s"
        proc.stdout.close()
        killed_at.append(delay)
        done = ResultWriter(out, resume=True).done_row_indices()
        # The parts hold exactly the rows that writer says are done, no more.
        on_disk = [i for p in parts(out) if not p.name.startswith(".tmp-")
                   for i in pq.read_table(p, columns=["row_index"]).column(0).to_pylist()]
        assert sorted(on_disk) == sorted(done) and len(set(on_disk)) == len(on_disk)
    w = ResultWriter(out, resume=True)
    for i in sorted(set(range(n)) - w.done_row_indices()):
        w.write(ResultRow(i, f"id{i}", f"text {i} " + "x" * (i % 50), "stop", 10, 3, i % 7))
    w.finalize(n)
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [f"id{i}" for i in range(n)], killed_at
    assert all(r["text"] == f"text {i} " + "x" * (i % 50) for i, r in enumerate(rows))
    assert all(r["completion_tokens"] == i % 7 for i, r in enumerate(rows))


def test_job_record_does_not_depend_on_the_order_of_prompts(tmp_path):
    from types import SimpleNamespace

    import torch

    from relaycli.io.reader import open_requests
    from relaycli.job import JobOptions, _job_record
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "x"}\n')
    arts = [SimpleNamespace(name=n, meta={"checksum": f"sha256:{n}"}, dtype=torch.float32) for n in ("a", "b")]
    loaded = SimpleNamespace(fingerprint="m")
    opts = JobOptions(input_path=src, output_path=tmp_path / "o.jsonl")
    before = _job_record(opts, open_requests(src), loaded, arts, "float32")
    assert before == _job_record(opts, open_requests(src), loaded, arts[::-1], "float32")
    src.write_text('{"prompt": "y"}\n')  # same length, other bytes
    assert _job_record(opts, open_requests(src), loaded, arts, "float32")["input_sha256"] != before["input_sha256"]


def test_warm_up_leaves_the_first_flush_no_import_and_writes_nothing(tmp_path):
    # The first part pyarrow builds imports what it loads lazily (pandas, where installed);
    # after warm_up the first flush imports nothing, and warm_up itself writes no file.
    code = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from relaycli.io.requests import ResultRow
        from relaycli.io.writer import ResultWriter
        out = Path({str(tmp_path / "out.parquet")!r})
        w = ResultWriter(out, flush_rows=1)
        listing = lambda: sorted(p.name for p in out.parent.iterdir())
        files = listing()
        w.warm_up()
        files = [f for f in listing() if f not in files]
        before = set(sys.modules)
        w.write(ResultRow(0, "a", "answer", "stop", prompt_tokens=3, cached_tokens=0, completion_tokens=1))
        print(json.dumps({{"files": files, "new": sorted(set(sys.modules) - before)}}))
    """)
    got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                     check=True, cwd=REPO).stdout.splitlines()[-1])
    assert got["files"] == []
    assert got["new"] == []
    assert len(parts(tmp_path / "out.parquet")) == 1

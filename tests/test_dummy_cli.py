"""`--model dummy:tiny` through the CLI: random weights with the default model's tokenizer
compile a prompt and answer a request file; a run in another process accepts the artifact."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from relaycli.artifact import read_artifact

SYSTEM = "You are a test assistant. Answer briefly."
PROMPTS = ["Hi", "What is 2 + 2?", "Name a colour.", "x"]


def relay(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from relaycli.cli import entry; entry()", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("dummyjob")
    (d / "sys.txt").write_text(SYSTEM)
    with open(d / "reqs.jsonl", "w") as f:
        for i, p in enumerate(PROMPTS):
            f.write(json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 4, "temperature": 0}) + "\n")
        f.write(json.dumps({"id": "other", "messages": [{"role": "system", "content": "Another system."},
                                                        {"role": "user", "content": "Hi"}], "max_tokens": 3}) + "\n")
    res = relay("compile-prompt", d / "sys.txt", "--model", "dummy:tiny", "--device", "cpu", "--quiet")
    assert res.returncode == 0, res.stderr[-2000:]
    return d


def _run(job, out, *extra) -> list[dict]:
    res = relay("run", "--in", job / "reqs.jsonl", "--out", out, "--prompt", job / "sys.relaykv",
                "--model", "dummy:tiny", "--device", "cpu", "--quiet", *extra)
    assert res.returncode == 0, res.stderr[-2000:]
    return pq.read_table(out).to_pylist()


def test_compile_prompt_with_a_dummy_model_renders_the_system_turn(job):
    art = read_artifact(job / "sys.relaykv")
    assert art.meta["model_reference"] == "dummy:tiny" and art.system_text == SYSTEM
    assert art.num_tokens > 5 and art.meta["num_layers"] == 2 and art.keys[0].shape[1:] == (2, 16)


def test_run_answers_every_row_and_a_second_run_accepts_the_artifact(job, tmp_path):
    first = _run(job, tmp_path / "a.parquet")
    assert [r["id"] for r in first] == [f"r{i}" for i in range(len(PROMPTS))] + ["other"]
    assert all(r["finish_reason"] in ("stop", "length") and r["error"] is None for r in first), first
    assert all(r["completion_tokens"] >= 1 for r in first)
    # Rows with the artifact's system text hit it; the row with its own system message misses.
    assert all(r["cached_tokens"] > 0 for r in first[:-1]) and first[-1]["cached_tokens"] == 0
    second = _run(job, tmp_path / "b.parquet")
    # Greedy rows are the same in the second process (seeded weights, same artifact).
    assert [(r["text"], r["completion_tokens"]) for r in second[:-1]] == \
        [(r["text"], r["completion_tokens"]) for r in first[:-1]]


def test_the_artifact_of_a_dummy_model_is_refused_by_another_model(job, tmp_path):
    res = relay("run", "--in", job / "reqs.jsonl", "--out", tmp_path / "c.parquet", "--prompt", job / "sys.relaykv",
                "--device", "cpu", "--quiet")
    assert res.returncode == 2
    assert "sys.relaykv was compiled for model dummy:tiny" in res.stderr and "recompile it" in res.stderr

"""Structured answers on CUDA: the Triton sampler under a constraint's mask (a finite floor),
masks and logprobs beside graphed decode steps, and forked completions' copied KV blocks.
CUDA only (skipped elsewhere; the CPU tests check the same engine on the torch path)."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("xgrammar")

from relaycli.config import EngineConfig  # noqa: E402
from relaycli.engine.engine import Engine  # noqa: E402
from relaycli.io.requests import RequestDefaults, parse_request  # noqa: E402
from relaycli.models.registry import load_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PROMPTS = ["Tell me about a cat.", "Describe the sea in one line, please, with many words and more words.",
           "A person as JSON.", "Pick a colour."]


def _rows():
    rows = []
    for i, p in enumerate(PROMPTS):
        rows += [{"id": f"c{i}", "prompt": p, "choices": ["red", "green", "blue"], "logprobs": True, "top_logprobs": 5},
                 {"id": f"s{i}", "prompt": p, "choices": ["alpha", "beta", "gamma delta"], "temperature": 1.3,
                  "top_k": 50, "top_p": 0.9, "seed": i},
                 {"id": f"r{i}", "prompt": p, "regex": r"[0-9]{3}-[a-z]{2,4}"},
                 {"id": f"j{i}", "prompt": p, "json_schema": SCHEMA, "max_tokens": 40},
                 {"id": f"p{i}", "prompt": p, "logprobs": True, "top_logprobs": 3, "max_tokens": 12},
                 {"id": f"n{i}", "prompt": p, "n": 3, "max_tokens": 12},
                 {"id": f"one{i}", "prompt": p, "max_tokens": 12}]
    return rows


def _run(device: str) -> tuple[Engine, dict]:
    lm = load_model(None, dtype="float32", device=device)
    engine = Engine(lm, [], EngineConfig(max_num_seqs=32, kv_cache_gb=1.0 if device == "cuda" else None))
    rows = [parse_request(r, i, RequestDefaults(max_tokens=16, temperature=0)) for i, r in enumerate(_rows())]
    return engine, {r.id: r for r in engine.generate(rows)}


def test_structured_rows_on_cuda_hold_and_match_the_cpu():
    engine, gpu = _run("cuda")
    _, cpu = _run("cpu")
    assert engine.stats.graphed_decode_steps > 0 and engine.stats.forks == 2 * len(PROMPTS)
    for i in range(len(PROMPTS)):
        assert gpu[f"c{i}"].text in ("red", "green", "blue") and gpu[f"c{i}"].finish_reason == "stop"
        assert gpu[f"s{i}"].text in ("alpha", "beta", "gamma delta") and gpu[f"s{i}"].finish_reason == "stop"
        if gpu[f"r{i}"].finish_reason == "stop":
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", gpu[f"r{i}"].text)
        if gpu[f"j{i}"].finish_reason == "stop":
            obj = json.loads(gpu[f"j{i}"].text)
            assert isinstance(obj["name"], str) and isinstance(obj["age"], int)
        # greedy completions of a forked row are the row's one answer: the copied KV block is right
        assert [c["text"] for c in gpu[f"n{i}"].completions] == [gpu[f"one{i}"].text] * 3
        for key in (f"c{i}", f"p{i}"):
            g, c = gpu[key].logprobs, cpu[key].logprobs
            if gpu[key].text == cpu[key].text:
                assert [e["logprob"] for e in g] == pytest.approx([e["logprob"] for e in c], abs=1e-3)
                assert [t["logprob"] for e in g for t in e["top_logprobs"]] == pytest.approx(
                    [t["logprob"] for e in c for t in e["top_logprobs"]], abs=1e-3)

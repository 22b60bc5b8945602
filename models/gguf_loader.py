"""GGUF files: config from the metadata, tensors dequantized and renamed to HF names."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from relaycli.models.config import ModelConfig, ModelConfigError

# GGUF architectures whose tensors this loader knows how to name and un-permute.
SUPPORTED_GGUF_ARCHS = ("llama",)

_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _reader(path: Path):
    from gguf import GGUFReader
    try:
        return GGUFReader(str(path))
    except Exception as exc:
        raise ModelConfigError(f"{path}: not a readable GGUF file ({exc})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(path: Path, reader=None) -> ModelConfig:
    reader = reader or _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelConfigError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    p = f"{arch}."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = int(_field(reader, p + "attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size")
    if vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens", []))
    if _field(reader, p + "rope.scaling.type") not in (None, "none"):
        raise ModelConfigError(f"{path}: GGUF rope scaling is not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, p + "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, p + "attention.key_length", hidden // heads)),
        max_position_embeddings=int(_field(reader, p + "context_length", 4096)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per head for its RoPE; undo it so the
    rotate-half RoPE of HF layouts applies."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(path: Path, config: ModelConfig, reader=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every tensor of the file, dequantized."""
    from gguf.quants import dequantize

    reader = reader or _reader(path)
    for t in reader.tensors:
        name = t.name
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ModelConfigError(f"{path}: unexpected GGUF tensor {name!r}")
            hf_name = f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
        elif name == "rope_freqs.weight":
            raise ModelConfigError(f"{path}: GGUF rope frequency tensors are not supported")
        else:
            raise ModelConfigError(f"{path}: unexpected GGUF tensor {name!r}")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if hf_name.endswith("q_proj.weight"):
            w = _unpermute(w, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        yield hf_name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


def open_gguf(path: Path):
    return _reader(path)

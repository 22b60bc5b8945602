"""Random-weight presets in real architectures' shapes, for benchmarks and tests.

A preset fixes the shapes of the layers; the vocabulary and the end-of-sequence ids
follow the tokenizer the model is run with (the registry gives every preset the default
model's), so that rendered chats and `relay run` work on random weights too.
"""

from __future__ import annotations

import dataclasses

import torch

from relaycli.models.config import ModelConfig
from relaycli.models.llama import CausalLM
from relaycli.models.weights import init_random_weights

_LLAMA2 = dict(architecture="LlamaForCausalLM", vocab_size=32000, max_position_embeddings=4096,
               rms_norm_eps=1e-5, rope_theta=10000.0)

PRESETS: dict[str, dict] = {
    "llama2-7b": dict(_LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, head_dim=128),
    "llama2-13b": dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40, head_dim=128),
    "llama3-8b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "mistral-7b": dict(architecture="MistralForCausalLM", vocab_size=32768, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                       rms_norm_eps=1e-5, rope_theta=1000000.0),
    "qwen2.5-7b": dict(architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True),
    # The default model's shapes (SmolLM2-135M-Instruct), for its host-bound jobs at any scale.
    "smollm2-135m": dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    # Small shapes for tests and CPU runs, with a context long enough for long prompts.
    "tiny": dict(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0),
}


def dummy_config(preset: str, tokenizer=None) -> ModelConfig:
    """The preset's config; with a tokenizer, its vocabulary size and end-of-sequence ids
    replace the preset's (the shapes of the layers stay the preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown dummy preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    config = ModelConfig(**PRESETS[preset])
    if tokenizer is None:
        return config
    return dataclasses.replace(config, vocab_size=int(tokenizer.vocab_size),
                               eos_token_ids=sorted(int(e) for e in tokenizer.eos_token_ids))


def dummy_model(preset: str, tokenizer, dtype: torch.dtype, device, seed: int) -> CausalLM:
    """The preset with the tokenizer's vocabulary and seeded random weights: the same seed
    gives the same weights in every process, so an artifact compiled in one fits another."""
    model = CausalLM(dummy_config(preset, tokenizer), dtype, device)
    init_random_weights(model, seed)
    return model

"""The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2).

Written for packed varlen batches: N tokens of many sequences in one [N, hidden]
matrix, explicit positions, and attention delegated to a callable that owns the KV
cache (see kernels/backend.py). Numerics follow transformers' modeling code step for
step (fp32 RMSNorm, RoPE tables cast to the run dtype), so logits match it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from relaycli.models.config import ModelConfig

# attend(layer_idx, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> o [N, Hq, D], q and k
# after RoPE. An attend with the attribute takes_rope = True is called with unrotated q, k
# and rope=(cos, sin, ops) instead, and applies ops.rope itself (so that a back end can
# rotate k straight into its cache).
AttendFn = Callable[..., torch.Tensor]


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class FusedLinear:
    """Projections of one input computed as one matmul (q/k/v, gate/up).

    Each part stays a Linear module under its usual name (transformers' names, so loaders
    and checkpoints see the usual layout), but its weight is a view into one
    [sum(sizes), in] tensor: one launch and one weight stream instead of several. A plain
    object, not a module, so the parameters are named once. Nothing may move the model
    with .to() afterwards: that would copy the views apart from the fused tensor.
    """

    def __init__(self, in_features: int, sizes: list[int], bias: bool, dtype, device,
                 part_names: tuple[str, ...]) -> None:
        self.sizes = list(sizes)
        self.part_names = part_names  # the parts' attribute names in the owning module
        self.weight = torch.empty(sum(sizes), in_features, dtype=dtype, device=device)
        self.bias = torch.empty(sum(sizes), dtype=dtype, device=device) if bias else None
        self.parts = [Linear(0, 0, False, dtype, "meta") for _ in sizes]
        self._view_parts()

    def _view_parts(self) -> None:
        start = 0
        for part, size in zip(self.parts, self.sizes):
            part.weight = nn.Parameter(self.weight[start:start + size], requires_grad=False)
            part.bias = None if self.bias is None else nn.Parameter(self.bias[start:start + size],
                                                                    requires_grad=False)
            start += size

    def adopt(self, leaf: str, tensor: torch.Tensor) -> None:
        """Make tensor (already of the fused shape, dtype and device) the fused weight or
        bias itself, without a copy; the parts become views into it."""
        setattr(self, leaf, tensor)
        self._view_parts()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, sum(sizes)]; split it with .split(self.sizes, -1)."""
        return nn.functional.linear(x, self.weight, self.bias)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] fp32, with Llama 3 wavelength-dependent scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, device) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, 1, D] in the run dtype (as transformers casts them)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; rotate-half convention (HF layout, not llama.cpp's interleaved one)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class EagerOps:
    """The elementwise parts of a layer as transformers writes them, in plain PyTorch.

    The model runner may pass another object with these methods (kernels/backend.py's
    fused Triton ops, which round the same way) to run them in fewer launches.
    """

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(residual + x), residual + x); residual None on the first layer."""
        residual = x if residual is None else residual + x
        return norm(residual), residual

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


EAGER_OPS = EagerOps()  # stateless


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.qkv = FusedLinear(c.hidden_size, [q_size, kv_size, kv_size], c.qkv_bias, dtype, device,
                               ("q_proj", "k_proj", "v_proj"))
        self.q_proj, self.k_proj, self.v_proj = self.qkv.parts
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, c.o_bias, dtype, device)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: AttendFn, ops: EagerOps) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).split(self.qkv.sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if getattr(attend, "takes_rope", False):
            o = attend(layer_idx, q, k, v, rope=(cos, sin, ops))
        else:
            q, k = ops.rope(q, k, cos, sin)
            o = attend(layer_idx, q, k, v)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up = FusedLinear(config.hidden_size, [size, size], False, dtype, device, ("gate_proj", "up_proj"))
        self.gate_proj, self.up_proj = self.gate_up.parts
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor, ops: EagerOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, device)
        self.mlp = MLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig, dtype, device) -> None:
        super().__init__()
        # Uninitialised, like every other parameter: loaders or init_random_weights fill it.
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class CausalLM(nn.Module):
    """Parameter names are transformers' (model.layers.N.self_attn.q_proj.weight, ...)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device="cpu") -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = _Backbone(config, dtype, device)
        self.rotary = RotaryEmbedding(config, device)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def fused_linears(self) -> dict[str, FusedLinear]:
        """Each fused projection by its storage name (model.layers.N.self_attn.qkv, ...)."""
        out = {}
        for i, layer in enumerate(self.model.layers):
            out[f"model.layers.{i}.self_attn.qkv"] = layer.self_attn.qkv
            out[f"model.layers.{i}.mlp.gate_up"] = layer.mlp.gate_up
        return out

    def _apply(self, fn, recurse=True):
        # .to()/.half()/.cuda() would copy the fused projections' part weights away from
        # the fused tensors that the forward multiplies by: refuse instead of going wrong.
        raise RuntimeError("relay's CausalLM cannot be moved or cast after it is built (its fused projections "
                           "share storage); load it with the device and dtype you need")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                ops: EagerOps | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden states [N, hidden] (after the last norm).

        The residual stream is carried beside the layer input, so that the add and the
        next norm can be one fused op. ops: the elementwise ops (None: EagerOps)."""
        ops = ops or EAGER_OPS
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = ops.add_rms_norm(x, residual, layer.input_layernorm)
            x = layer.self_attn(i, x, cos, sin, attend, ops)
            x, residual = ops.add_rms_norm(x, residual, layer.post_attention_layernorm)
            x = layer.mlp(x, ops)
        return ops.add_rms_norm(x, residual, self.model.norm)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [M, hidden] -> logits [M, vocab] in the weights' dtype, written into out
        [M, vocab] (that dtype, contiguous) if given.

        They are not widened to fp32 here: the sampler reads them in fp32 itself, which
        gives the same values (bf16 to fp32 is exact) without a [M, vocab] fp32 copy a step."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if out is None:
            return nn.functional.linear(hidden, weight)
        assert out.dtype == weight.dtype and out.is_contiguous(), "out must be contiguous, in the weights' dtype"
        return torch.mm(hidden, weight.t(), out=out)

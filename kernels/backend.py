"""Attention back ends behind one call: write this step's k/v, then attend.

`relay`: system step per shared prefix (all queries at once) + context step + fusion.
`no-relay`: the baseline, one softmax per request over prefix + own keys.
`impl`: "torch" (kernels/reference.py, any device), "cpu-flash" (the same algorithms on
PyTorch's fused CPU attention, kernels/cpu_flash.py) or "triton" (CUDA kernels).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from relaycli.kernels import planner, reference
from relaycli.kernels.metadata import AttentionMetadata, LayerPrefixes
from relaycli.kernels.planner import AttentionPlan, default_impl, triton_available, triton_interpreted

__all__ = ["ATTENTION_IMPLS", "ATTENTION_MODES", "PagedAttention", "TritonLayerOps", "default_impl", "layer_ops",
           "triton_available", "triton_runs_on"]

ATTENTION_MODES = ("relay", "no-relay")
ATTENTION_IMPLS = ("torch", "cpu-flash", "triton")


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on device: CUDA with Triton, or any device under
    Triton's interpreter (TRITON_INTERPRET=1, set before triton loads: the CPU tests)."""
    if triton_available(device):
        return True
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return triton_interpreted()


class TritonLayerOps:
    """relaycli.models.llama.EagerOps in fused Triton kernels (CUDA), rounding at the same points
    (results within about one unit in the last place of the eager ops).

    pdl: each kernel is launched as a programmatic dependent of the product before it
    (relaycli.kernels.pdl: the same results, the launch overlapping that product's tail)."""

    def __init__(self, pdl: bool = False) -> None:
        from relaycli.kernels.triton_rms_norm import add_rms_norm
        from relaycli.kernels.triton_rope import rope, rope_into_cache
        from relaycli.kernels.triton_silu_mul import silu_mul
        self._add_rms_norm, self._rope, self._silu_mul = add_rms_norm, rope, silu_mul
        self._rope_into_cache = rope_into_cache
        self.pdl = pdl

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
        return self._add_rms_norm(x, residual, norm.weight, norm.eps, pdl=self.pdl)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rope(q, k, cos, sin, pdl=self.pdl)

    def rope_into_cache(self, q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        return self._rope_into_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, pdl=self.pdl)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(gate_up, pdl=self.pdl)


def layer_ops(impl: str, device: torch.device | None = None):
    """Fused elementwise ops for this attention impl, or None for the eager ones; on a
    Hopper-class GPU they launch as programmatic dependents (relaycli.kernels.pdl)."""
    if impl != "triton":
        return None
    from relaycli.kernels.pdl import pdl_supported
    return TritonLayerOps(pdl=device is not None and pdl_supported(device))


class PagedAttention:
    """Owns the per-layer paged KV cache and the per-layer KV of the loaded prefixes.

    k_caches[layer], v_caches[layer]: [num_blocks, block_size, Hkv, D].
    prefixes[slot] = (keys per layer, values per layer), each [S, Hkv, D].
    store: keep each layer's prefixes in one store (relaycli.kernels.metadata.LayerPrefixes), which
    steps with a PrefixTable read; the slots are then views of it (prefix_layers).
    store_tokens: rows the store has room for at least (prefixes added while the engine runs).
    """

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 prefixes: list[tuple[list[torch.Tensor], list[torch.Tensor]]], mode: str, impl: str,
                 scale: float, store: bool = False, store_tokens: int = 0) -> None:
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
        self.k_caches, self.v_caches = k_caches, v_caches
        self.mode, self.impl, self.scale = mode, impl, scale
        num_layers = len(k_caches)
        # Per layer, the (k, v) of every prefix slot: what the kernels take.
        pairs = [[(keys[i], values[i]) for keys, values in prefixes] for i in range(num_layers)]
        self.prefix_layers = [LayerPrefixes.stored(p, store_tokens) if store else LayerPrefixes(p) for p in pairs]
        # the second stream of relay's overlapped decode step (whichever kernel the step
        # launches first; high priority, so the block scheduler places its programs first),
        # one per engine so every captured graph forks onto the same stream
        self.side_stream = None
        if impl == "triton":
            from relaycli.kernels import triton_ops
            self._ops = triton_ops
            if mode == "relay" and k_caches and k_caches[0].is_cuda:
                self.side_stream = triton_ops.pool_stream(k_caches[0].device, high_priority=True)
        elif impl == "cpu-flash":
            from relaycli.kernels import cpu_flash
            self._ops = cpu_flash
        else:
            self._ops = reference

    def graph_plan(self, num_seqs: int, num_heads: int, slot: int | None, context_tokens: int,
                   max_context_len: int, mixed: bool = False) -> AttentionPlan | None:
        """The plan (kernels/planner.py decode_graph_plan) of relay's Triton decode step captured
        in a CUDA graph: num_seqs rows on prefix `slot`, or, mixed, on several prefixes through
        a PrefixTable over the store; own keys totalling context_tokens, none longer than
        max_context_len. None where the step has no such plan (no prefix, --no-relay, other
        impls): it is then planned by its shapes alone, the same for every total."""
        if self.impl != "triton" or self.mode != "relay" or (slot is None and not mixed) or not self.k_caches:
            return None
        k_cache, layer = self.k_caches[0], self.prefix_layers[0]
        prefix_tokens = None if mixed else layer[slot][0].shape[0]
        table_keys = max(k.shape[0] for k, _ in layer) if mixed else None
        return planner.decode_graph_plan(num_seqs, num_heads, k_cache.shape[2], k_cache.shape[3],
                                         k_cache.element_size(), k_cache.shape[1], k_cache.device, prefix_tokens,
                                         table_keys, context_tokens, max_context_len)

    def row_order(self, plan: AttentionPlan | None, own_lengths: list[int], num_heads: int) -> list[int] | None:
        """The order a graphed step's rows run in under `plan` (planner.row_order), as indices
        into own_lengths; None: as given."""
        if not self.k_caches:
            return None
        k_cache = self.k_caches[0]
        return planner.row_order(plan, own_lengths, num_heads // k_cache.shape[2], k_cache.shape[1])

    def attend_fn(self, meta: AttentionMetadata) -> Callable:
        """relaycli.models.llama.AttendFn for this step's metadata; it takes rope=(cos, sin, layer_ops).

        Given rope, q and k arrive unrotated and the layer ops' RoPE is applied here: with
        the Triton impl and TritonLayerOps in one launch that also stores k and v in the
        cache (the same values as rope, then write_kv)."""
        ops, scale = self._ops, self.scale
        fn = ops.relay_attention if self.mode == "relay" else ops.prefix_paged_attention
        if self.side_stream is not None:
            fn = functools.partial(fn, side_stream=self.side_stream)
        fuse = self.impl == "triton"

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope=None) -> torch.Tensor:
            k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
            if rope is None:
                ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            elif fuse and isinstance(rope[2], TritonLayerOps):
                q = rope[2].rope_into_cache(q, k, v, rope[0], rope[1], k_cache, v_cache, meta.slot_mapping)
            else:
                q, k = rope[2].rope(q, k, rope[0], rope[1])
                ops.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            return fn(q, k_cache, v_cache, meta, self.prefix_layers[layer], scale)

        attend.takes_rope = True
        return attend

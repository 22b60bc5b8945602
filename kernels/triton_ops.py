"""Triton attention entry points with the signatures of kernels/reference.py.

relay_attention puts a step together by the first of these that applies:
- fused own-key step: a CUDA graph's decode step (meta.graphed) whose rows all share one
  prefix, where triton_plan.fused_decode_plan says it pays: kernels/gluon_fused_relay.py
  (the own keys inside the warp-specialised system program), then the merge kernel;
- table step: rows of several prefixes given as a PrefixTable (decode graphs): one grouped
  system launch over the prefix store (kernels/triton_grouped_system.py), then the context
  step and the merge kernel, on two streams in a graph's step;
- overlap: other graphed decode steps: the system kernel (all queries of a prefix
  group and the G heads of a KV head stacked, split-K over the prefix into fp32 partials)
  and the paged context kernel on two streams at once, the matrix-bound one first, then
  the merge kernel;
- fused epilogue: eager steps (prefill, eager decode): one system launch per prefix group,
  then one paged context launch whose epilogue merges the system partials and writes o
  once. When the own contexts are long and the sequences few, the context step is split
  too; its partials then join the system ones in one buffer and the merge kernel finishes.
Split counts, tiles and order: plan_relay_step here and kernels/triton_plan.py.
"""

from __future__ import annotations

import torch
import triton

from relaycli.kernels import reference
from relaycli.kernels.metadata import AttentionMetadata
from relaycli.kernels.triton_context_attention import check_paged, context_splits, paged_attention
from relaycli.kernels.triton_grouped_system import grouped_system_attention_into
from relaycli.kernels.triton_paged_decode import group_prefixes
from relaycli.kernels.triton_paged_decode import prefix_paged_attention as _baseline
from relaycli.kernels.triton_plan import (DECODE_TILE, fused_decode_plan, fused_tile, matrix_bound, resident_splits, split_plan,
                                 system_config)
from relaycli.kernels.triton_system_attention import merge_partials, system_attention_into

__all__ = ["relay_attention", "relay_attention_with", "prefix_paged_attention", "write_kv"]


def relay_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    prefixes: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                    side_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """RelayAttention; same contract as relaycli.kernels.reference.relay_attention. Returns o [N, Hq, D].

    side_stream: the stream the overlapped context step runs on (the engine passes the one
    its attention backend owns); None takes one from torch's stream pool."""
    return relay_attention_with(q, k_cache, v_cache, meta, prefixes, scale, side_stream=side_stream)


def relay_attention_with(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         prefixes: list[tuple[torch.Tensor, torch.Tensor]], scale: float, *,
                         sys_splits: int | None = None, ctx_splits: int | None = None,
                         sys_config: dict | None = None, ctx_config: dict | None = None,
                         overlap: bool | None = None, system_side: bool | None = None,
                         resident: bool | None = None, side_stream: torch.cuda.Stream | None = None,
                         fused: bool | None = None) -> torch.Tensor:
    """relay_attention with the split factors and tile configs exposed (tests, tuning).

    overlap: run the (memory-bound) context kernel and the (matrix-bound) system kernel
    on two streams at once; the context then writes a partial and the merge kernel
    finishes, instead of the fused epilogue. None: only for a CUDA graph's decode steps
    (meta.graphed), whose capture pays the extra stream's host time once (in eager steps
    that time exceeds the gain). system_side: the system kernel goes first, on the side
    stream, so the block scheduler places its programs ahead of the context kernel's many
    small ones (None: when the step overlaps and its system step is matrix-bound).
    resident: with system_side, plan the system split count so that its programs take at
    most one slot an SM and context programs run beside them (plan_system: None where that
    fits under the context step, True always, False never). docs/kernels.md has the
    measurements.
    side_stream: the overlap's second stream, owned by the caller (relaycli.kernels.backend.PagedAttention
    keeps one per engine); None takes one from torch's stream pool (high priority with system_side).
    fused: None: a CUDA graph's decode step (meta.graphed), every row behind one prefix, runs
    the own keys inside the warp-specialised system program (kernels/gluon_fused_relay.py),
    then the merge kernel, where triton_plan.fused_decode_plan says it runs and pays and no
    knob above is set; False: never. Other steps take the paths above.
    A step with a PrefixTable (rows of several prefixes, as device data) runs its system
    step as one grouped launch over the prefix store (kernels/triton_grouped_system.py),
    split as the table says, then the same context step and merge.
    """
    check_paged(q, k_cache, v_cache, meta)
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    table = meta.prefix_table
    assert table is None or prefixes.store is not None, "a prefix table needs the prefixes in one store"
    groups = group_prefixes(meta, prefixes)
    knobs = (sys_splits, ctx_splits, sys_config, ctx_config, overlap, system_side, resident)
    assert fused in (None, False), "fused: None (where the plan says) or False (never)"
    if fused is None and not any(k is not None for k in knobs):
        splits = fused_step_splits(q, k_cache, v_cache, meta, groups)
        if splits is not None:
            from relaycli.kernels.gluon_fused_relay import fused_relay_decode  # Gluon: sm_90 only
            (_, k_sys, v_sys), = groups
            return fused_relay_decode(q.contiguous(), k_sys, v_sys, k_cache, v_cache, meta.block_tables,
                                      meta.context_lens, scale, splits, **fused_tile(n, hq, hkv))[0]
    c_splits = context_splits(meta, q, hkv, 0, ctx_splits, ctx_config, read_ahead=True)
    if overlap is None:
        overlap = q.is_cuda and meta.is_decode and meta.graphed
    s_splits = 0
    if table is not None:
        s_splits = table.num_splits
        system_side = True if system_side is None else system_side
    elif groups:
        system_side, s_splits, sys_config = plan_relay_step(
            group_sizes(groups), context_tokens(meta), hq, hkv, d, q.element_size(), q.device,
            overlapped=overlap, system_side=system_side, resident=resident, config=sys_config,
            num_splits=sys_splits)
    overlap = overlap and s_splits > 0
    if not s_splits and c_splits == 1:
        out = torch.empty((1, n, hq, d), dtype=q.dtype, device=q.device)
        paged_attention(q, k_cache, v_cache, meta, scale, out=out, config=ctx_config, read_ahead=True)
        return out[0]
    extra = c_splits if c_splits > 1 or overlap else 0
    o_part = torch.empty(s_splits + extra, n, hq, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(s_splits + extra, n, hq, dtype=torch.float32, device=q.device)
    if groups and sum(int(g.query_indices.shape[0]) for g, _, _ in groups) < n:
        lse_part[:s_splits].fill_(float("-inf"))  # rows without a prefix: the system side is empty

    def system_step():
        if table is not None:
            grouped_system_attention_into(q, *prefixes.store, table, scale, o_part[:s_splits], lse_part[:s_splits])
        for g, k_sys, v_sys in groups:
            assert g.query_indices.dtype == torch.int64, "PrefixGroup.query_indices must be int64"
            system_attention_into(q, k_sys, v_sys, scale, o_part[:s_splits], lse_part[:s_splits],
                                  rows=g.query_indices, num_splits=s_splits, config=sys_config, graphed=meta.graphed)

    def context_step():
        paged_attention(q, k_cache, v_cache, meta, scale, out=o_part, lse=lse_part, split_base=s_splits,
                        num_splits=c_splits, config=ctx_config, read_ahead=True)

    if not extra:  # the fused path: the context epilogue merges the system partials, o written once
        system_step()
        out = torch.empty((1, n, hq, d), dtype=q.dtype, device=q.device)
        paged_attention(q, k_cache, v_cache, meta, scale, out=out, config=ctx_config, read_ahead=True,
                        sys_part=(o_part[:s_splits], lse_part[:s_splits]))
        return out[0]
    if overlap and q.is_cuda:
        main = torch.cuda.current_stream(q.device)
        side = side_stream if side_stream is not None else pool_stream(q.device, high_priority=system_side)
        side.wait_stream(main)
        first, second = (system_step, context_step) if system_side else (context_step, system_step)
        with torch.cuda.stream(side):
            first()
        second()
        main.wait_stream(side)  # before the merge, and before any buffer here can be freed
    else:
        system_step()
        context_step()
    return merge_partials(o_part, lse_part, q.dtype, with_lse=False)[0]


def fused_step_splits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      groups: list) -> int | None:
    """The fused decode step's system splits for this step, or None where it takes another
    path: it needs a CUDA graph's decode step (meta.graphed: TMA descriptors are built on
    the host once, for the capture), one prefix group that holds every row (groups list
    their rows in order, so it reads row n's own keys for query n), contiguous system KV and cache,
    block tables with unit column stride, and fused_decode_plan's shapes. A graph key's plan
    (graphed_decode_plan) prices the same sizes, so a key says "fused" exactly where its
    captured step takes this path, as long as these layout checks hold (they do for the
    engine's caches and decode graphs; where one fails, the step takes another path that
    computes the same function)."""
    if not (q.is_cuda and meta.is_decode and meta.max_seqlen_q == 1 and len(groups) == 1
            and meta.graphed):
        return None
    (g, k_sys, v_sys), = groups
    n, hq, d = q.shape
    if not (g.query_indices.shape[0] == n and k_sys.is_contiguous() and v_sys.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous() and meta.block_tables.stride(1) == 1
            and q.dtype == k_sys.dtype):
        return None
    return fused_decode_plan(n, hq, k_cache.shape[2], d, q.element_size(), k_cache.shape[1], q.device,
                             k_sys.shape[0], context_tokens(meta), meta.max_context_len)


def plan_relay_step(sizes: list[tuple[int, int]], num_context_tokens: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, elem: int, device: torch.device, *, overlapped: bool,
                    system_side: bool | None = None, resident: bool | None = None, config: dict | None = None,
                    num_splits: int | None = None) -> tuple[bool, int, dict]:
    """(system kernel first?, system splits, system tile) of a relay step with prefix groups
    `sizes` (group_sizes) and num_context_tokens own keys (context_tokens).

    overlapped: the step runs its two kernels at once (the overlap), so their
    order and the system split plan go by the step's sizes (overlap_work); other steps plan
    for the tile alone. system_side, resident, config, num_splits: relay_attention_with's
    (None: chosen here)."""
    work = overlap_work(sizes, num_context_tokens, num_heads, num_kv_heads, head_dim, elem) if overlapped else None
    if system_side is None:  # a byte-bound system step gains nothing from going first
        system_side = work is not None and matrix_bound(*work[:2])
    splits, tile = plan_system(sizes, num_heads, num_kv_heads, head_dim, elem, device, config, num_splits,
                               resident if work is not None and system_side else False, work)
    return system_side, splits, tile


def plan_system(sizes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, elem: int,
                device: torch.device, config: dict | None, num_splits: int | None,
                resident: bool | None, work: tuple[float, float, float] | None) -> tuple[int, dict]:
    """The system step's split count (num_splits, when given, wins) and tile.

    sizes: (query rows, prefix tokens) of each prefix group (group_sizes); config: the system tile (None:
    system_config's, except below). resident: False plans for the tile's per_sm programs
    an SM (split_plan); None plans for at most one an SM where triton_plan.resident_splits
    finds that the system kernel then fits under the context step, else as False; True
    plans for at most one an SM regardless. work: overlap_work's sizes (needed unless
    resident is False). Where the system kernel fits beside the context, an unforced tile
    is DECODE_TILE, not the warp-specialised one: that claims a whole SM's registers, so no
    context program would run beside it. Where the system step is the longer one, the
    warp-specialised tile is the faster. Measured on the H200; docs/kernels.md has the numbers.
    """
    rows = max(n for n, _ in sizes) * (num_heads // num_kv_heads)
    tile = config or system_config(rows, head_dim, device, elem, num_kv_heads)
    longest = max(s for _, s in sizes)

    def programs(cfg: dict) -> int:
        return triton.cdiv(rows, cfg["BLOCK_M"]) * num_kv_heads
    if num_splits is None and resident is not False:
        _, sys_bytes, ctx_bytes = work
        beside = DECODE_TILE if config is None and tile.get("ws", False) is not False else tile
        fit = resident_splits(programs(beside), longest, beside["BLOCK_M"], head_dim, sys_bytes, ctx_bytes, device)
        if fit is not None:
            return fit, dict(beside)
        if resident:
            return split_plan(longest, programs(tile), device, tile["BLOCK_N"], per_sm=1)[0], tile
    return split_plan(longest, programs(tile), device, tile["BLOCK_N"], num_splits,
                      per_sm=tile.get("per_sm", 1))[0], tile


def group_sizes(groups: list) -> list[tuple[int, int]]:
    """(query rows, prefix tokens) of each (PrefixGroup, k_sys, v_sys) of a step: what its plan goes by."""
    return [(int(g.query_indices.shape[0]), int(k.shape[0])) for g, k, _ in groups]


def context_tokens(meta: AttentionMetadata) -> int:
    """The own keys a step's plan prices: meta.context_tokens where the host gave them (the
    sum over the real rows), else num_seqs x max_context_len (for a CUDA graph without it,
    its bucket's upper bound)."""
    return meta.context_tokens if meta.context_tokens is not None else meta.num_seqs * meta.max_context_len


def overlap_work(sizes: list[tuple[int, int]], num_context_tokens: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, elem: int) -> tuple[float, float, float]:
    """(system flops, system bytes, context bytes) of a step, from host-side sizes only:
    group_sizes and the own keys the step reads (context_tokens)."""
    flops = sum(4.0 * n * num_heads * s * head_dim for n, s in sizes)
    sys_bytes = sum(2.0 * s * num_kv_heads * head_dim * elem for _, s in sizes)
    ctx_bytes = 2.0 * num_context_tokens * num_kv_heads * head_dim * elem
    return flops, sys_bytes, ctx_bytes


def graphed_decode_plan(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, elem: int,
                        device: torch.device, prefix_tokens: int, num_context_tokens: int,
                        block_size: int, max_context_len: int) -> tuple[int, str]:
    """(system splits, kernel) that relay_attention_with plans for a decode step captured in
    a CUDA graph: num_seqs rows (padding included) in one prefix group, num_context_tokens
    own keys in all, none longer than max_context_len (the graph's context bucket), cache
    blocks of block_size keys. kernel: "fused" (the own keys inside
    the system program), else the overlapped step's system tile with its default order and
    residency, "ws" (warp-specialised) or "tile". A decode graph keys on it, so that steps
    whose real contexts want another plan get a graph of their own (a graph's bucket only
    bounds its longest row)."""
    splits = fused_decode_plan(num_seqs, num_heads, num_kv_heads, head_dim, elem, block_size, device,
                               prefix_tokens, num_context_tokens, max_context_len)
    if splits is not None:
        return splits, "fused"
    _, splits, tile = plan_relay_step([(num_seqs, prefix_tokens)], num_context_tokens, num_heads, num_kv_heads,
                                      head_dim, elem, device, overlapped=True)
    return splits, "ws" if "ws" in tile else "tile"


def pool_stream(device: torch.device, high_priority: bool = False) -> torch.cuda.Stream:
    """A stream from torch's per-device pool (torch.cuda.Stream hands out pooled streams
    round-robin, so a call per step creates none); high priority: the block scheduler places
    its programs first."""
    return torch.cuda.Stream(device=device, priority=-100 if high_priority else 0)  # clamped to the highest


def prefix_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           prefixes: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """The --no-relay baseline; same contract as relaycli.kernels.reference.prefix_paged_attention."""
    return _baseline(q, k_cache, v_cache, meta, prefixes, scale)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's k/v [N, Hkv, D] at their flat slots of the paged cache (in place)."""
    reference.check_kv_write(k_cache, v_cache, k, v, slot_mapping)
    reference.write_kv(k_cache, v_cache, k, v, slot_mapping)

"""The system part of a relay step's plan: which kernel goes first, its split count and tile.

kernels/planner.py asks plan_system_step for a step with prefix groups; the arithmetic is
kernels/triton_plan.py's. docs/kernels.md has the measurements behind the rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaycli.kernels import triton_plan as tp
from relaycli.kernels.tiles import DECODE_TILE, Tile


@dataclass(frozen=True)
class StepShape:
    """The host-side sizes of one attention step: what its plan goes by.

    num_rows: query rows (q.shape[0]); groups: (query rows, prefix tokens) of each non-empty
    prefix group; table_keys: the longest prefix of a PrefixTable step (None: no table);
    context_tokens: the own keys the plan prices (planner.context_tokens); graphed: a CUDA
    graph's step (captured, or the eager pass before its capture)."""

    num_rows: int
    num_seqs: int
    is_decode: bool
    max_seqlen_q: int
    max_context_len: int
    context_tokens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    elem: int
    block_size: int
    groups: tuple[tuple[int, int], ...]
    table_keys: int | None
    graphed: bool
    device: torch.device


def resolve(tile: Tile, graphed: bool) -> Tile:
    """The tile with its graph-only parts (tma, gluon None) decided for a step: taken in a
    CUDA graph's steps, whose host work (tensor descriptors) a capture pays once."""
    return tile.replace(tma=graphed if tile.tma is None else tile.tma,
                        gluon=graphed if tile.gluon is None else tile.gluon)


def overlap_work(sizes: tuple[tuple[int, int], ...], num_context_tokens: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, elem: int) -> tuple[float, float, float]:
    """(system flops, system bytes, context bytes) of a step, from host-side sizes only:
    its groups' (query rows, prefix tokens) and the own keys the step reads."""
    flops = sum(4.0 * n * num_heads * s * head_dim for n, s in sizes)
    sys_bytes = sum(2.0 * s * num_kv_heads * head_dim * elem for _, s in sizes)
    ctx_bytes = 2.0 * num_context_tokens * num_kv_heads * head_dim * elem
    return flops, sys_bytes, ctx_bytes


def plan_system_step(s: StepShape, overlapped: bool) -> tuple[bool, int, Tile]:
    """(system kernel first?, system splits, system tile) of a relay step with prefix groups.

    overlapped: the step runs its two kernels at once (a CUDA graph's decode step), so their
    order and the split plan go by the step's sizes (overlap_work): the system kernel goes
    first, on the side stream, where it is matrix-bound (the block scheduler then places its
    programs ahead of the context kernel's many small ones; a byte-bound system step gains
    nothing from going first), and then its split count is planned to leave room for the
    context beside it (system_splits' resident). Other steps plan for the tile alone."""
    work = overlap_work(s.groups, s.context_tokens, s.num_heads, s.num_kv_heads, s.head_dim, s.elem) \
        if overlapped else None
    first = work is not None and tp.matrix_bound(*work[:2])
    rows = max(n for n, _ in s.groups) * (s.num_heads // s.num_kv_heads)
    tile = tp.system_config(rows, s.head_dim, s.device, s.elem, s.num_kv_heads)
    splits, tile = system_splits(s, tile, first, work)
    return first, splits, tile


def system_splits(s: StepShape, tile: Tile, resident: bool,
                  work: tuple[float, float, float] | None) -> tuple[int, Tile]:
    """The system step's split count and tile (tile: system_config's).

    resident: plan for at most one program an SM where triton_plan.resident_splits finds
    that the system kernel then fits under the context step (work: overlap_work's sizes);
    there the tile is DECODE_TILE, not the warp-specialised one, which claims a whole SM's
    registers, so no context program would run beside it. Elsewhere (not resident, or no
    such fit) the split count is planned for the tile's per_sm programs an SM (split_plan):
    where the system step is the longer one, the warp-specialised tile is the faster."""
    longest = max(keys for _, keys in s.groups)
    rows = max(n for n, _ in s.groups) * (s.num_heads // s.num_kv_heads)

    def programs(t: Tile) -> int:
        return -(-rows // t.block_m) * s.num_kv_heads
    if resident:
        _, sys_bytes, ctx_bytes = work
        beside = DECODE_TILE if tile.ws else tile
        fit = tp.resident_splits(programs(beside), longest, beside.block_m, s.head_dim, sys_bytes, ctx_bytes,
                                 s.device)
        if fit is not None:
            return fit, beside
    return tp.split_plan(longest, programs(tile), s.device, tile.block_n, per_sm=tile.per_sm)[0], tile

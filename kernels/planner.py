"""The attention planner: which path, tiles, splits and row order a step's attention takes.

A plan is an AttentionPlan: a kind (one of KINDS; kernels/README.md has each kind's kernels,
tests and rule) and the parameters its kernels launch with. kernels/triton_ops.py executes
a plan and chooses nothing; the engine keys its decode graphs on the plan of their step
(decode_graph_plan) and lays out a graph's rows by row_order. Tests and benchmarks force a
variant by building a plan (dataclasses.replace of the planner's). The arithmetic behind
the tiles and splits is kernels/triton_plan.py's; the relay step's system part is planned
by kernels/system_plan.py.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass

import torch

from relaycli.kernels import triton_plan as tp
from relaycli.kernels.metadata import AttentionMetadata
from relaycli.kernels.system_plan import StepShape, plan_system_step, resolve
from relaycli.kernels.tiles import FusedTile, MergeTile, Tile

RELAY_FUSED = "relay-fused"  # own keys inside the warp-specialised system program, then the merge
RELAY_OVERLAP = "relay-overlap"  # system and context kernels on two streams, then the merge
RELAY_EPILOGUE = "relay-epilogue"  # system partials folded in by the context kernel's epilogue
RELAY_MERGE = "relay-merge"  # system and (split) context partials, one after the other, then the merge
CONTEXT = "context"  # the paged context kernel alone (relay with no prefix, context_attention)
BASELINE = "baseline"  # --no-relay: one softmax over prefix + own keys a request (split or not)
SYSTEM = "system"  # system_attention alone: the system kernel, then the merge where split
KINDS = (RELAY_FUSED, RELAY_OVERLAP, RELAY_EPILOGUE, RELAY_MERGE, CONTEXT, BASELINE, SYSTEM)


@dataclass(frozen=True)
class AttentionPlan:
    """What one attention call launches. sys_splits: the system step's partials (the fused
    kernel's prefix splits); sys_tile: its tile (a PrefixTable step's: the grouped kernel's);
    ctx_splits and ctx_tiles: each paged launch's key chunks and tile, in launch order (the
    baseline: one a prefix group, then the rows without one); merge: the merge kernel's
    launch, where partials are merged; system_first: the overlap's side stream takes the
    system kernel (else the context kernel); fused: the fused kernel's tile."""

    kind: str
    sys_splits: int = 0
    sys_tile: Tile | None = None
    ctx_splits: int = 1
    ctx_tiles: tuple[Tile, ...] = ()
    merge: MergeTile | None = None
    system_first: bool = False
    fused: FusedTile | None = None

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"plan kind must be one of {KINDS}, got {self.kind!r}"


def triton_available(device: torch.device) -> bool:
    """Triton's kernels compile for this device: CUDA with Triton importable."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
        from relaycli.kernels import triton_ops  # noqa: F401
    except Exception:
        return False
    return True


def default_impl(device: torch.device) -> str:
    """The fastest attention implementation this device has: "triton" (CUDA), "cpu-flash"
    (PyTorch's fused CPU attention, kernels/cpu_flash.py) or "torch" (kernels/reference.py)."""
    if triton_available(device):
        return "triton"
    if device.type == "cpu":
        from relaycli.kernels import cpu_flash
        if cpu_flash.is_available():
            return "cpu-flash"
    return "torch"


def triton_interpreted() -> bool:
    """Triton's interpreter runs the kernels (TRITON_INTERPRET=1, set before triton loads)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def merge_tile(num_rows: int, num_heads: int, head_dim: int, device: torch.device, pdl: bool = False) -> MergeTile:
    """The merge kernel's launch over num_rows rows of num_heads heads: its head block
    (triton_plan.merge_block_h) and the splits it loads at once for that grid (merge_unroll)."""
    block_h = tp.merge_block_h(num_rows, num_heads, head_dim, device)
    return MergeTile(block_h, tp.merge_unroll(num_rows * -(-num_heads // block_h), device), pdl)


def step_shape(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, groups: list) -> StepShape:
    """The sizes a relay step's plan goes by: groups are (PrefixGroup, k_sys, v_sys) of its
    non-empty prefix groups; a PrefixTable step's groups are empty and its table says the rest."""
    table = meta.prefix_table
    return StepShape(
        num_rows=q.shape[0], num_seqs=meta.num_seqs, is_decode=meta.is_decode, max_seqlen_q=meta.max_seqlen_q,
        max_context_len=meta.max_context_len, context_tokens=context_tokens(meta), num_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2], head_dim=q.shape[2], elem=q.element_size(), block_size=k_cache.shape[1],
        groups=tuple((int(g.query_indices.shape[0]), int(k.shape[0])) for g, k, _ in groups),
        table_keys=table.max_keys if table is not None else None, graphed=meta.graphed, device=q.device)


def context_tokens(meta: AttentionMetadata) -> int:
    """The own keys a step's plan prices: meta.context_tokens where the host gave them (the
    sum over the real rows), else num_seqs x max_context_len (for a CUDA graph without it,
    its bucket's upper bound)."""
    return meta.context_tokens if meta.context_tokens is not None else meta.num_seqs * meta.max_context_len


def fused_layout_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    groups: list) -> bool:
    """The tensors the fused decode kernel reads by TMA: one prefix group holding every row
    in order (it reads row n's own keys for query n), contiguous prefix KV and cache, block
    tables with a unit column stride, the prefix in q's dtype. They hold for the engine's
    caches and decode graphs; where one fails, the step takes another kind, which computes
    the same function."""
    if len(groups) != 1:
        return False
    (g, k_sys, v_sys), = groups
    return (g.query_indices.shape[0] == q.shape[0] and k_sys.is_contiguous() and v_sys.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous() and meta.block_tables.stride(1) == 1
            and q.dtype == k_sys.dtype)


def plan_relay(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               groups: list) -> AttentionPlan:
    """The plan of relay_attention for this step (groups: triton_paged_decode.group_prefixes'),
    made once a step: every layer's call has the same sizes (kept in the step's metadata)."""
    shape = step_shape(q, k_cache, meta, groups)
    layout = fused_layout_ok(q, k_cache, v_cache, meta, groups)
    key = ("relay plan", shape, layout)
    if key not in meta._cache:
        meta._cache[key] = plan_relay_shape(shape, layout)
    return meta._cache[key]


def plan_relay_shape(s: StepShape, fused_layout: bool = True) -> AttentionPlan:
    """A relay step's plan from its sizes; the first rule that applies gives the kind:
    - RELAY_FUSED: a CUDA graph's decode step whose rows all share one prefix (fused_layout),
      where triton_plan.fused_decode_plan says the fused kernel runs and pays (sm_90);
    - RELAY_OVERLAP: other CUDA graph decode steps with a system part (a prefix group or a
      PrefixTable), whose capture pays the second stream's host time once;
    - CONTEXT: no system part and an unsplit context;
    - RELAY_EPILOGUE: an unsplit context: its epilogue merges the system partials;
    - RELAY_MERGE: a split context (few sequences, long own contexts): the merge kernel."""
    cuda = s.device.type == "cuda"
    graphed_decode = cuda and s.is_decode and s.graphed
    if graphed_decode and s.max_seqlen_q == 1 and len(s.groups) == 1 and s.groups[0][0] == s.num_rows \
            and fused_layout and s.table_keys is None:
        splits = tp.fused_decode_plan(s.num_rows, s.num_heads, s.num_kv_heads, s.head_dim, s.elem, s.block_size,
                                      s.device, s.groups[0][1], s.context_tokens, s.max_context_len)
        if splits is not None:
            return AttentionPlan(RELAY_FUSED, sys_splits=splits, fused=tp.fused_tile(s.num_rows, s.num_heads,
                                                                                     s.num_kv_heads),
                                 merge=merge_tile(s.num_rows, s.num_heads, s.head_dim, s.device, pdl=True))
    ctx_splits = context_splits(s, 0, read_ahead=True)
    system_first, sys_splits, sys_tile = False, 0, None
    if s.table_keys is not None:
        system_first, sys_tile = True, tp.grouped_config(s.device)
        sys_splits = tp.grouped_splits(s.num_seqs, s.num_heads, s.num_kv_heads, s.table_keys, s.device)
    elif s.groups:
        system_first, sys_splits, sys_tile = plan_system_step(s, overlapped=graphed_decode)
        sys_tile = resolve(sys_tile, cuda and s.graphed)
    overlap = graphed_decode and sys_splits > 0
    if not sys_splits and ctx_splits == 1:
        return AttentionPlan(CONTEXT, ctx_tiles=(context_tile(s, 1, read_ahead=True),))
    if ctx_splits == 1 and not overlap:
        return AttentionPlan(RELAY_EPILOGUE, sys_splits, sys_tile, 1, (context_tile(s, 1, read_ahead=True),))
    tiles = (context_tile(s, ctx_splits, read_ahead=True),)
    kind = RELAY_OVERLAP if overlap else RELAY_MERGE
    merge = merge_tile(s.num_rows, s.num_heads, s.head_dim, s.device)
    return AttentionPlan(kind, sys_splits, sys_tile, ctx_splits, tiles, merge, system_first)


def context_splits(s: StepShape, extra_keys: int, read_ahead: bool) -> int:
    """How many chunks to cut each sequence's (extra_keys + own keys) into, for sequences
    too few to fill the chip; planned for the longest, max_context_len. read_ahead: the
    launch takes read-ahead tiles on a small grid (relay's context step)."""
    group = s.num_heads // s.num_kv_heads
    grid = s.num_seqs * s.num_kv_heads
    keys = extra_keys + s.max_context_len
    tile = tp.paged_config(s.max_seqlen_q * group, s.head_dim, s.device, s.elem, keys, grid if read_ahead else None)
    programs = grid * -(-s.max_seqlen_q * group // tile.block_m)
    return tp.split_plan(keys, programs, s.device, tile.block_n, min_keys=512, per_sm=tile.per_sm)[0]


def context_tile(s: StepShape, splits: int, read_ahead: bool, prefix_keys: int | None = None) -> Tile:
    """The paged kernel's tile for chunks of (prefix_keys + own keys) / splits keys; a launch
    with a prefix in front (prefix_keys not None) keeps neighbouring sequences on one head
    (they share the prefix in L2)."""
    keys = -(-(s.max_context_len + (prefix_keys or 0)) // splits)
    tile = tp.paged_config(s.max_seqlen_q * (s.num_heads // s.num_kv_heads), s.head_dim, s.device, s.elem, keys,
                           s.num_seqs * s.num_kv_heads if read_ahead else None)
    return tile.replace(heads_fast=prefix_keys is None)


def plan_baseline(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, groups: list) -> AttentionPlan:
    """The --no-relay baseline's plan (BASELINE): its split count for the longest prefix, and
    a tile a paged launch (a prefix group's, then the rows without a prefix; a PrefixTable
    step: one launch over the prefix store)."""
    s = step_shape(q, k_cache, meta, groups)
    key = ("baseline plan", s)
    if key not in meta._cache:  # once a step: every layer's call has the same sizes
        meta._cache[key] = _plan_baseline(s)
    return meta._cache[key]


def _plan_baseline(s: StepShape) -> AttentionPlan:
    prefix_lens = [s.table_keys] if s.table_keys is not None else [keys for _, keys in s.groups]
    splits = context_splits(s, max(prefix_lens, default=0), read_ahead=False)
    tiles = tuple(context_tile(s, splits, False, keys) for keys in prefix_lens)
    if s.table_keys is None:
        tiles += (context_tile(s, splits, False),)
    merge = merge_tile(s.num_rows, s.num_heads, s.head_dim, s.device) if splits > 1 else None
    return AttentionPlan(BASELINE, ctx_splits=splits, ctx_tiles=tiles, merge=merge)


def plan_context(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> AttentionPlan:
    """context_attention's plan (CONTEXT): one unsplit paged launch."""
    return AttentionPlan(CONTEXT, ctx_tiles=(context_tile(step_shape(q, k_cache, meta, []), 1, False),))


def plan_system(q: torch.Tensor, k_sys: torch.Tensor) -> AttentionPlan:
    """system_attention's plan (SYSTEM): the tile for all queries of a KV head stacked, the
    split count for its grid, and the merge where it splits."""
    n, hq, d = q.shape
    hkv = k_sys.shape[1]
    tile = resolve(tp.system_config(n * hq // hkv, d, q.device, q.element_size(), hkv), False)
    programs = -(-(n * hq // hkv) // tile.block_m) * hkv
    splits = tp.split_plan(k_sys.shape[0], programs, q.device, tile.block_n, per_sm=tile.per_sm)[0]
    merge = merge_tile(n, hq, d, q.device) if splits > 1 else None
    return AttentionPlan(SYSTEM, sys_splits=splits, sys_tile=tile, merge=merge)


def decode_graph_plan(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, elem: int,
                      block_size: int, device: torch.device, prefix_tokens: int | None, table_keys: int | None,
                      num_context_tokens: int, max_context_len: int) -> AttentionPlan:
    """The plan of relay's decode step captured in a CUDA graph: num_seqs rows (padding
    included), all behind one prefix of prefix_tokens, or of several prefixes in a
    PrefixTable whose longest has table_keys; num_context_tokens own keys in all, none
    longer than max_context_len (the graph's context bucket). The same plan as plan_relay
    gives the captured step, so a graph keyed by it runs it; steps whose real contexts want
    another plan get a graph of their own (a bucket only bounds its longest row)."""
    groups = ((num_seqs, prefix_tokens),) if prefix_tokens is not None else ()
    return plan_relay_shape(StepShape(
        num_rows=num_seqs, num_seqs=num_seqs, is_decode=True, max_seqlen_q=1, max_context_len=max_context_len,
        context_tokens=num_context_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        elem=elem, block_size=block_size, groups=groups, table_keys=table_keys, graphed=True, device=device))


def row_order(plan: AttentionPlan | None, own_lengths: list[int], group: int, block_size: int) -> list[int] | None:
    """The order a step's rows should run in, as indices into own_lengths (None: as given).

    A RELAY_FUSED plan: program (m, h, split) of the fused kernel attends, one block after
    another, the own keys of the rows whose first query row is among its 128 and whose
    index within them is split modulo the split count, so the step lasts as long as its most
    loaded program. Rows are dealt longest first, each to the least loaded such program with
    a free row (LPT), which leaves the most loaded one at most one row's blocks above the
    mean. Any order computes the same outputs (each row is its own sequence's); ties keep
    the given order, so a batch whose lengths cross no block boundary keeps its rows."""
    if plan is None or plan.kind != RELAY_FUSED:
        return None
    rows = tp.fused_program_rows(len(own_lengths), group, plan.sys_splits)
    heap = [(0, i) for i in range(len(rows))]
    taken = [0] * len(rows)
    order = [0] * len(own_lengths)
    cost = [max(1, -(-n // block_size)) for n in own_lengths]
    for j in sorted(range(len(own_lengths)), key=lambda j: -cost[j]):
        load, i = heapq.heappop(heap)
        order[rows[i][taken[i]]] = j
        taken[i] += 1
        if taken[i] < len(rows[i]):
            heapq.heappush(heap, (load + cost[j], i))
    return order

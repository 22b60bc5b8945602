"""The --no-relay baseline in Triton: per-request attention over prefix + own keys.

Each request reads its shared prefix itself (as vLLM's prefix caching does) and its own
paged keys, all in ONE online softmax (the paged kernel of triton_context_attention with
HAS_PREFIX). Decode has one query per request, so B * Hkv programs can be too few to
keep every multiprocessor streaming at 8k keys; the key range is then cut into splits
(flash-decoding) whose fp32 partials are merged by the system file's merge kernel.
"""

from __future__ import annotations

import torch

from relaycli.kernels.metadata import AttentionMetadata
from relaycli.kernels.planner import AttentionPlan, plan_baseline
from relaycli.kernels.triton_context_attention import check_paged, paged_attention
from relaycli.kernels.triton_merge import merge_partials


def group_prefixes(meta: AttentionMetadata, prefixes: list[tuple[torch.Tensor, torch.Tensor]]):
    """[(group, k_sys, v_sys)] for the step's non-empty prefix groups, checked against the metadata."""
    out = []
    for group in meta.prefix_groups:
        assert 0 <= group.prefix_slot < len(prefixes), f"prefix slot {group.prefix_slot} is not loaded"
        k_sys, v_sys = prefixes[group.prefix_slot]
        assert k_sys.shape[0] == group.num_prefix_tokens, \
            f"prefix slot {group.prefix_slot} has {k_sys.shape[0]} tokens, metadata says {group.num_prefix_tokens}"
        if group.seq_indices.shape[0]:
            out.append((group, k_sys, v_sys))
    return out


def sequence_groups(meta: AttentionMetadata, groups) -> tuple[torch.Tensor | None, bool]:
    """(seq_group [B] int32 or None, whether some sequences have no prefix).

    Sequence b belongs to prefix group seq_group[b], in the order of groups; a sequence
    without a prefix to the group numbered len(groups), which its own launch serves. None
    when one group holds every sequence: then no launch needs to filter.
    """
    covered = sum(int(g.seq_indices.shape[0]) for g, _, _ in groups)
    rest = covered < meta.num_seqs
    if len(groups) == 1 and not rest:
        return None, False
    if not groups:
        return None, True
    seq_group = torch.full((meta.num_seqs,), len(groups), dtype=torch.int32, device=meta.context_lens.device)
    for gid, (g, _, _) in enumerate(groups):
        seq_group[g.seq_indices] = gid
    return seq_group, rest


def prefix_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           prefixes: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Same contract as relaycli.kernels.reference.prefix_paged_attention.

    q [N, Hq, D]; caches [num_blocks, block_size, Hkv, D]; prefixes[slot] = (k, v) [S, Hkv, D].
    Returns o [N, Hq, D] in q's dtype, as kernels/planner.py's BASELINE plan says.
    """
    check_paged(q, k_cache, v_cache, meta)
    groups = group_prefixes(meta, prefixes) if meta.prefix_table is None else []
    return run_baseline(plan_baseline(q, k_cache, meta, groups), q, k_cache, v_cache, meta, prefixes, scale)


def run_baseline(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, prefixes: list[tuple[torch.Tensor, torch.Tensor]],
                 scale: float) -> torch.Tensor:
    """The baseline as a BASELINE plan says: its split count, a tile a launch (each prefix
    group's, then the rows without a prefix; a PrefixTable step: one launch reading each row's
    prefix range of the store), then the merge where split."""
    check_paged(q, k_cache, v_cache, meta)
    splits = plan.ctx_splits
    if splits == 1:
        out, lse = torch.empty((1,) + tuple(q.shape), dtype=q.dtype, device=q.device), None
    else:
        out = torch.empty((splits,) + tuple(q.shape), dtype=torch.float32, device=q.device)
        lse = torch.empty((splits,) + tuple(q.shape[:2]), dtype=torch.float32, device=q.device)
    table = meta.prefix_table
    if table is not None:  # several prefixes as device data: one launch reads each row's from the store
        assert prefixes.store is not None, "a prefix table needs the prefixes in one store"
        paged_attention(q, k_cache, v_cache, meta, scale, out=out, lse=lse, num_splits=splits,
                        prefix=prefixes.store, prefix_table=table, tile=plan.ctx_tiles[0])
    else:
        groups = group_prefixes(meta, prefixes)
        seq_group, rest = sequence_groups(meta, groups)
        common = dict(out=out, lse=lse, num_splits=splits, seq_group=seq_group)
        for gid, (_, k_sys, v_sys) in enumerate(groups):
            paged_attention(q, k_cache, v_cache, meta, scale, prefix=(k_sys, v_sys), group_id=gid,
                            tile=plan.ctx_tiles[gid], **common)
        if rest:
            paged_attention(q, k_cache, v_cache, meta, scale, group_id=len(groups), tile=plan.ctx_tiles[-1],
                            **common)
    if splits == 1:
        return out[0]
    return merge_partials(out, lse, q.dtype, plan.merge, with_lse=False)[0]

"""Triton attention entry points with the signatures of kernels/reference.py, and the
executor of relay's plans.

relay_attention asks kernels/planner.py for the step's plan and runs it (execute). A plan's
kind names the launches, which the runners below make as the plan's parameters say:
- relay-fused: kernels/gluon_fused_relay.py (the own keys inside the warp-specialised
  system program), then the merge kernel;
- relay-overlap: the system step (one launch a prefix group, all queries of the group and
  the G heads of a KV head stacked, split-K over the prefix into fp32 partials; or, for a
  step with a PrefixTable, one grouped launch over the prefix store,
  kernels/triton_grouped_system.py) and the paged context kernel on two streams at once,
  the plan's first on the side stream, then the merge kernel;
- relay-epilogue: the system step, then one paged context launch whose epilogue merges the
  system partials and writes o once;
- relay-merge: the system step and the split context step one after the other, their
  partials in one buffer, then the merge kernel;
- context: the paged context kernel alone.
"""

from __future__ import annotations

import torch

from relaycli.kernels import planner, reference
from relaycli.kernels.metadata import AttentionMetadata
from relaycli.kernels.planner import AttentionPlan
from relaycli.kernels.triton_context_attention import check_paged, paged_attention
from relaycli.kernels.triton_grouped_system import grouped_system_attention_into
from relaycli.kernels.triton_paged_decode import group_prefixes
from relaycli.kernels.triton_paged_decode import prefix_paged_attention as _baseline
from relaycli.kernels.triton_merge import merge_partials
from relaycli.kernels.triton_system_attention import system_attention_into

__all__ = ["relay_attention", "execute", "prefix_paged_attention", "write_kv"]


def relay_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    prefixes: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                    side_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """RelayAttention; same contract as relaycli.kernels.reference.relay_attention. Returns o [N, Hq, D].

    side_stream: the stream the overlapped step's first kernel runs on (the engine passes
    the one its attention backend owns); None takes one from torch's stream pool."""
    check_paged(q, k_cache, v_cache, meta)
    assert meta.prefix_table is None or prefixes.store is not None, "a prefix table needs the prefixes in one store"
    groups = group_prefixes(meta, prefixes)
    plan = planner.plan_relay(q, k_cache, v_cache, meta, groups)
    return _RUNNERS[plan.kind](plan, q, k_cache, v_cache, meta, prefixes, groups, scale, side_stream)


def execute(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, prefixes: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
            side_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """Relay attention as `plan` says (a plan of kernels/planner.py, or one a test or benchmark
    built from it); the same function for every plan that can run here."""
    check_paged(q, k_cache, v_cache, meta)
    assert meta.prefix_table is None or prefixes.store is not None, "a prefix table needs the prefixes in one store"
    groups = group_prefixes(meta, prefixes)
    return _RUNNERS[plan.kind](plan, q, k_cache, v_cache, meta, prefixes, groups, scale, side_stream)


def _fused(plan, q, k_cache, v_cache, meta, prefixes, groups, scale, side_stream):
    from relaycli.kernels.gluon_fused_relay import fused_relay_decode  # Gluon: sm_90 only
    (_, k_sys, v_sys), = groups
    return fused_relay_decode(q.contiguous(), k_sys, v_sys, k_cache, v_cache, meta.block_tables, meta.context_lens,
                              scale, plan.sys_splits, plan.fused, plan.merge)[0]


def _context(plan, q, k_cache, v_cache, meta, prefixes, groups, scale, side_stream):
    out = torch.empty((1,) + tuple(q.shape), dtype=q.dtype, device=q.device)
    paged_attention(q, k_cache, v_cache, meta, scale, out=out, tile=plan.ctx_tiles[0])
    return out[0]


def _partials(plan, q, num_parts):
    """The fp32 partial buffers of a step: the system splits first, then num_parts more."""
    n, hq, d = q.shape
    s = plan.sys_splits
    o_part = torch.empty(s + num_parts, n, hq, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(s + num_parts, n, hq, dtype=torch.float32, device=q.device)
    return o_part, lse_part


def _system_step(plan, q, meta, prefixes, groups, scale, o_part, lse_part):
    """The system partials o_part[:sys_splits]: one grouped launch for a PrefixTable step,
    else a launch a prefix group; rows without a prefix get lse = -inf (w = 0)."""
    s = plan.sys_splits
    table = meta.prefix_table
    if table is not None:
        grouped_system_attention_into(q, *prefixes.store, table, scale, o_part[:s], lse_part[:s], plan.sys_tile)
        return
    if groups and sum(int(g.query_indices.shape[0]) for g, _, _ in groups) < q.shape[0]:
        lse_part[:s].fill_(float("-inf"))  # rows without a prefix: the system side is empty
    for g, k_sys, v_sys in groups:
        assert g.query_indices.dtype == torch.int64, "PrefixGroup.query_indices must be int64"
        system_attention_into(q, k_sys, v_sys, scale, o_part[:s], lse_part[:s], g.query_indices, plan.sys_tile)


def _epilogue(plan, q, k_cache, v_cache, meta, prefixes, groups, scale, side_stream):
    o_part, lse_part = _partials(plan, q, 0)
    _system_step(plan, q, meta, prefixes, groups, scale, o_part, lse_part)
    out = torch.empty((1,) + tuple(q.shape), dtype=q.dtype, device=q.device)
    paged_attention(q, k_cache, v_cache, meta, scale, out=out, sys_part=(o_part, lse_part), tile=plan.ctx_tiles[0])
    return out[0]


def _context_step(plan, q, k_cache, v_cache, meta, scale, o_part, lse_part):
    paged_attention(q, k_cache, v_cache, meta, scale, out=o_part, lse=lse_part, split_base=plan.sys_splits,
                    num_splits=plan.ctx_splits, tile=plan.ctx_tiles[0])


def _merge(plan, q, k_cache, v_cache, meta, prefixes, groups, scale, side_stream):
    o_part, lse_part = _partials(plan, q, plan.ctx_splits)
    _system_step(plan, q, meta, prefixes, groups, scale, o_part, lse_part)
    _context_step(plan, q, k_cache, v_cache, meta, scale, o_part, lse_part)
    return merge_partials(o_part, lse_part, q.dtype, plan.merge, with_lse=False)[0]


def _overlap(plan, q, k_cache, v_cache, meta, prefixes, groups, scale, side_stream):
    """The system and context steps on two streams at once (on CUDA; one after the other
    elsewhere), the plan's first on the side stream, then the merge."""
    o_part, lse_part = _partials(plan, q, plan.ctx_splits)
    steps = (lambda: _system_step(plan, q, meta, prefixes, groups, scale, o_part, lse_part),
             lambda: _context_step(plan, q, k_cache, v_cache, meta, scale, o_part, lse_part))
    first, second = steps if plan.system_first else steps[::-1]
    if q.is_cuda:
        main = torch.cuda.current_stream(q.device)
        side = side_stream if side_stream is not None else pool_stream(q.device, high_priority=plan.system_first)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            first()
        second()
        main.wait_stream(side)  # before the merge, and before any buffer here can be freed
    else:
        first()
        second()
    return merge_partials(o_part, lse_part, q.dtype, plan.merge, with_lse=False)[0]


_RUNNERS = {planner.RELAY_FUSED: _fused, planner.RELAY_OVERLAP: _overlap, planner.RELAY_EPILOGUE: _epilogue,
            planner.RELAY_MERGE: _merge, planner.CONTEXT: _context}


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

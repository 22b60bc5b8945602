"""Relay decode attention in one grid: system and context programs side by side.

Why: the system step is bound by the tensor cores and the context step by memory, so
together they could take little more than the longer of the two. Launched one after the
other, or on two streams, they barely overlap on the H200 (docs/benchmarks.md, the
overlap table): the block scheduler fills every SM with the first kernel's programs
before it places any of the second's. Here one launch holds both kinds of program,
interleaved by program id (a system program every `period` programs while they last), so
an SM's resident programs are a mix of the two from the first wave on.

Both roles write fp32 partials into one buffer, the system splits first and the context
as the last slot ([sys_splits + 1, N, Hq, D] and [sys_splits + 1, N, Hq]); the merge
kernel finishes. Decode only (one query per sequence), one prefix group. The roles share
the launch's num_warps and num_stages (and so its shared memory and occupancy), so both
use small tiles: a system program of 64 rows and the context program of one sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.metadata import AttentionMetadata
from kernels.triton_context_attention import _paged_program, check_paged
from kernels.triton_plan import tma_ok
from kernels.triton_system_attention import LOG2E, _system_program, check_prefix

# spread: interleave the system programs among the context ones (False: they come first);
# CTX_HEADS: KV heads a context program takes in turn (a divisor of the KV head count)
# The default is the fastest config of the H200 sweep (docs/results/grid_sweep_h200_s8.log).
GRID_CONFIG = dict(SYS_BLOCK_M=64, SYS_BLOCK_N=32, CTX_BLOCK_N=64, CTX_HEADS=1, num_warps=4, num_stages=2,
                   spread=True)


@triton.jit(do_not_specialize=["n_sys_programs", "period", "sys_m_tiles", "n_queries_sys", "keys_per_split",
                               "sys_splits"])
def _relay_grid_kernel(q_ptr, ks_ptr, vs_ptr, rows_ptr, kc_ptr, vc_ptr, o_ptr, lse_ptr, cu_ptr, ctx_ptr, bt_ptr,
                       n_sys_programs, period, sys_m_tiles, n_queries_sys, seq_len, keys_per_split, sys_splits,
                       num_kv_heads, qk_scale,
                       stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                       stride_kb, stride_kt, stride_kch, stride_vb, stride_vt, stride_vch, stride_bt,
                       stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                       G: tl.constexpr, D: tl.constexpr, SYS_BLOCK_M: tl.constexpr, SYS_BLOCK_N: tl.constexpr,
                       CTX_BLOCK_M: tl.constexpr, CTX_BLOCK_N: tl.constexpr, CTX_HEADS: tl.constexpr,
                       PAGE: tl.constexpr,
                       HAS_ROWS: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid // period
    if (pid % period == 0) & (idx < n_sys_programs):
        # system program idx, in the system kernel's grid order (row tile, KV head, split)
        _system_program(idx % sys_m_tiles, (idx // sys_m_tiles) % num_kv_heads, idx // (sys_m_tiles * num_kv_heads),
                        q_ptr, ks_ptr, vs_ptr, rows_ptr, o_ptr, lse_ptr, n_queries_sys, seq_len, keys_per_split,
                        qk_scale, stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                        stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                        G, D, SYS_BLOCK_M, SYS_BLOCK_N, HAS_ROWS, IEEE, TMA)
    else:
        # context program c: the system programs at or before this pid come off. It takes
        # CTX_HEADS neighbouring KV heads of one sequence in turn (the same pages), so that
        # few resident programs still keep a long stream of loads in flight.
        c = pid - tl.minimum(idx + 1, n_sys_programs)
        per_seq = num_kv_heads // CTX_HEADS
        for hh in tl.static_range(CTX_HEADS):
            _paged_program(0, c // per_seq, (c % per_seq) * CTX_HEADS + hh, 0,
                           q_ptr, kc_ptr, vc_ptr, kc_ptr, vc_ptr, o_ptr, lse_ptr, o_ptr, lse_ptr,
                           cu_ptr, ctx_ptr, bt_ptr, ctx_ptr, 0, 0, 1, sys_splits, 0, qk_scale,
                           stride_qn, stride_qh, stride_kb, stride_kt, stride_kch, stride_vb, stride_vt, stride_vch,
                           0, 0, stride_bt, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                           0, 0, 0, 0, 0, G, D, CTX_BLOCK_M, CTX_BLOCK_N, PAGE,
                           False, False, False, 4, True, IEEE, False, False)


def relay_grid_into(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    k_sys: torch.Tensor, v_sys: torch.Tensor, rows: torch.Tensor | None, scale: float,
                    o_part: torch.Tensor, lse_part: torch.Tensor, *, config: dict | None = None,
                    tma: bool | None = None) -> None:
    """One launch: rows' queries against the prefix into slots 0..s-1, every query's own keys into slot s.

    q [N, Hq, D] decode queries (one per sequence); caches [num_blocks, block_size, Hkv, D];
    k_sys/v_sys [S, Hkv, D]; rows [n] int64 (the prefix group's queries) or None (all);
    o_part [s + 1, N, Hq, D] fp32, lse_part [s + 1, N, Hq] fp32, s >= 1 system splits.
    config: GRID_CONFIG's keys, any of them.
    tma: K/V of the prefix through tensor descriptors; None: only inside CUDA-graph capture.
    """
    unknown = set(config or {}) - set(GRID_CONFIG)
    assert not unknown, f"unknown relay grid config keys {sorted(unknown)}; known: {sorted(GRID_CONFIG)}"
    check_paged(q, k_cache, v_cache, meta)
    check_prefix(q, k_sys, v_sys)
    assert meta.is_decode and meta.max_seqlen_q == 1, "the relay grid serves decode steps (one query a sequence)"
    assert meta.num_seqs == q.shape[0], "decode: one query per sequence"
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    assert k_sys.shape[1] == hkv, f"prefix has {k_sys.shape[1]} KV heads, the cache {hkv}"
    assert o_part.dim() == 4 and o_part.shape[1:] == q.shape and o_part.shape[0] >= 2, "o_part: [s + 1, N, Hq, D]"
    assert o_part.dtype == torch.float32 and o_part.stride(-1) == 1, "o_part must be fp32 with a unit last stride"
    assert lse_part.shape == o_part.shape[:3] and lse_part.dtype == torch.float32 and lse_part.stride(-1) == 1
    if rows is not None:
        assert rows.dim() == 1 and rows.dtype == torch.int64, "rows must be [n] int64"
    sys_splits = o_part.shape[0] - 1
    n_sys_q = n if rows is None else rows.shape[0]
    if n == 0:
        return
    cfg = dict(GRID_CONFIG, **(config or {}))
    ctx_block_m = max(16, triton.next_power_of_2(group))
    sys_rows = n_sys_q * group
    sys_m_tiles = triton.cdiv(sys_rows, cfg["SYS_BLOCK_M"]) if sys_rows else 0
    n_sys = sys_m_tiles * hkv * sys_splits
    assert hkv % cfg["CTX_HEADS"] == 0, f"CTX_HEADS={cfg['CTX_HEADS']} must divide the {hkv} KV heads"
    n_ctx = n * hkv // cfg["CTX_HEADS"]
    period = max(1, (n_sys + n_ctx) // n_sys) if cfg["spread"] and n_sys else 1
    seq_len = k_sys.shape[0]
    per = triton.cdiv(triton.cdiv(max(seq_len, 1), sys_splits), cfg["SYS_BLOCK_N"]) * cfg["SYS_BLOCK_N"]
    if tma is None:
        tma = q.is_cuda and torch.cuda.is_current_stream_capturing()
    tma = tma and seq_len >= cfg["SYS_BLOCK_N"] and tma_ok(k_sys) and tma_ok(v_sys)
    k_arg, v_arg = k_sys, v_sys
    if tma:  # the copy engine fetches [SYS_BLOCK_N, D] tiles of the [S, Hkv*D] view
        k_arg, v_arg = (TensorDescriptor.from_tensor(t.view(seq_len, -1), [cfg["SYS_BLOCK_N"], d])
                        for t in (k_sys, v_sys))
    _relay_grid_kernel[(n_sys + n_ctx,)](
        q, k_arg, v_arg, rows if rows is not None else q, k_cache, v_cache, o_part, lse_part,
        meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
        n_sys, period, max(sys_m_tiles, 1), n_sys_q, seq_len, per, sys_splits, hkv, scale * LOG2E,
        q.stride(0), q.stride(1), k_sys.stride(0), k_sys.stride(1), v_sys.stride(0), v_sys.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), meta.block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        G=group, D=d, SYS_BLOCK_M=cfg["SYS_BLOCK_M"], SYS_BLOCK_N=cfg["SYS_BLOCK_N"], CTX_BLOCK_M=ctx_block_m,
        CTX_BLOCK_N=cfg["CTX_BLOCK_N"], CTX_HEADS=cfg["CTX_HEADS"], PAGE=meta.block_size, HAS_ROWS=rows is not None,
        IEEE=q.dtype == torch.float32, TMA=tma, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

"""Decode relay attention for Hopper with the own keys inside the warp-specialised system program.

At GQA heads (llama3-8b) the system step is bound by the tensor cores and the own-key step
by bytes, yet as two kernels they take the sum of their times: the warp-specialised system
program holds an SM's whole register file, so no context program runs beside it. Here the
program gets a third role: beside the two prefix consumer warpgroups
(kernels/gluon_system_attention.py's, under a lower register cap) and their TMA warp, an
own-key warpgroup with a TMA warp of its own attends the own keys of the program's requests
while the prefix consumers keep the tensor cores busy.

A request's own keys serve only its G query rows, so with the queries as the wgmma's M rows
(64 a warpgroup) an own tile would waste 1 - G/64 of its tensor work. The own keys are
computed transposed instead ("swap AB"), the keys as M and the request's query rows as N = 8:

    S^T [C keys, 8] = K_c [C, D] . Q_n^T [D, 8]             (A: K from shared memory)
    softmax over the keys (axis 0), online across chunks
    O^T [D, 8]     += V_c^T [D, C] . P^T [C, 8]              (A: V transposed, B: P from shared)

so an own chunk costs two small wgmma chains and 4 + 8 accumulator registers a thread. The
8 query rows are the TMA box of Q's rows n*Hq + h*G .. +8: the first G are the request's,
the rest other heads' (finite, ignored). Own keys are paged; a chunk is one cache block
(block_size == C), one TMA for its K and one for its V, into a ring of CTX_TILES [C, D] slots.
The keys are spread over the warpgroup's 4 warps, so a chunk's max and sum cross warps:
where a request has two chunks left the warpgroup takes both in one step (one max, one sum
and one barrier per 128 keys), which halves that cross-warp work.

Result: the system partials at splits 0..num_splits-1 as the system kernel writes them, the
own-key partial of every (request, head) at split num_splits, then merge_partials. Work:
program (m, h, split) takes the own keys of the requests whose first query row is among its
128, ceil(m*128/G) + i, i = split, split + num_splits, ..., so every request belongs to
exactly one program for any G, also where G does not divide 128.

kernels/planner.py plans it (relay-fused) for graphed decode steps where
triton_plan.fused_decode_plan says it pays, on 64-key cache blocks, with triton_plan.fused_tile's
prefix tile.
Measured on the H200; docs/kernels.md has the numbers.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from relaycli.kernels.gluon_own_keys import QN, _ctx_consumer, _ctx_producer, _q_slots
from relaycli.kernels.gluon_system_attention import LOG2E, WS_PRODUCER_REGS, _ws_consumer, _ws_producer, _ws_ring
from relaycli.kernels.tiles import FusedTile, MergeTile
from relaycli.kernels.triton_plan import FUSED_CHUNK
from relaycli.kernels.triton_merge import merge_partials

# Registers a thread: the program is 16 warps (the two TMA warps share a warpgroup), so the
# launch's cap is 128 (16 x 128 x 32 = 64K); then the prefix consumers get FusedTile.sys_regs
# (176 by default: the system kernel's consumers at a 128 cap, where 64-key tiles fit
# without spills), the own-key warpgroup ctx_regs (136), the TMA warps 24:
# 8 x 176 + 4 x 136 + 4 x 24 = 2048.
LAUNCH_REGS = 128


@gluon.jit(do_not_specialize=["n_queries", "keys_per_split", "num_splits", "stride_bt"])
def _fused_kernel(q_ptr, k_desc, v_desc, kc_desc, vc_desc, q_desc, ctx_ptr, bt_ptr, o_ptr, lse_ptr,
                  n_queries, seq_len, keys_per_split, num_splits, qk_scale, stride_bt,
                  stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                  HQ: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, C: gl.constexpr, CTX_TILES: gl.constexpr,
                  Q_SMEM: gl.constexpr, SYS_REGS_: gl.constexpr, CTX_REGS_: gl.constexpr):
    """grid (cdiv(n*G, 128), Hkv, num_splits); 4 warps (the first prefix consumer) + a second
    prefix consumer, the own-key warpgroup and two TMA warps."""
    pid_m = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    dtype: gl.constexpr = k_desc.dtype
    k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = _ws_ring(k_desc, v_desc, STAGES, BLOCK_N, D)
    cr = gl.allocate_shared_memory(dtype, [CTX_TILES, C, D], kc_desc.layout)  # own K and V tiles (vc_desc's too)
    qc = gl.allocate_shared_memory(dtype, [_q_slots(CTX_TILES), QN, D], q_desc.layout)
    pc = gl.allocate_shared_memory(dtype, [2, QN, C], gl.NVMMASharedLayout.get_default_for([QN, C], dtype))
    c_ready = gl.allocate_shared_memory(gl.int64, [CTX_TILES, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [CTX_TILES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CTX_TILES):
        mbarrier.init(c_ready.index(i), count=1)
        mbarrier.init(c_empty.index(i), count=1)
    if Q_SMEM:  # Q of the two prefix consumers in shared memory: their registers go to 128-key tiles
        qs = gl.allocate_shared_memory(dtype, [2, 64, D], gl.NVMMASharedLayout.get_default_for([64, D], dtype))
        q0 = qs.index(0)
        q1 = qs.index(1)
    else:  # unused
        q0 = k_smem
        q1 = k_smem
    lo = split * keys_per_split
    hi = gl.minimum(lo + keys_per_split, seq_len)
    num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    row0 = pid_m * 128
    col = h * D
    # the requests whose first query row is among the program's 128 (any G: at G = 3 a
    # request's rows may straddle two programs, and the first one takes its own keys)
    req_lo = (row0 + G - 1) // G
    req_hi = gl.minimum((row0 + 128 + G - 1) // G, n_queries)
    gl.warp_specialize([
        (_ws_consumer, (q_ptr, q_ptr, o_ptr, lse_ptr, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready,
                        k_empty, v_empty, row0, h, split, n_queries, lo, hi, num_tiles, col, qk_scale,
                        stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                        G, D, BLOCK_N, STAGES, False, Q_SMEM, q0)),
        (_ws_consumer, (q_ptr, q_ptr, o_ptr, lse_ptr, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready,
                        k_empty, v_empty, row0 + 64, h, split, n_queries, lo, hi, num_tiles, col, qk_scale,
                        stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                        G, D, BLOCK_N, STAGES, False, Q_SMEM, q1)),
        (_ctx_consumer, (cr, qc, pc, c_ready, c_empty, ctx_ptr, o_ptr, lse_ptr,
                         req_lo, h, split, num_splits, req_hi, qk_scale,
                         stride_os, stride_on, stride_oh, stride_ls, stride_ln, G, D, C, CTX_TILES)),
        (_ws_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lo, num_tiles, col,
                        STAGES, BLOCK_N)),
        (_ctx_producer, (kc_desc, vc_desc, q_desc, cr, qc, c_ready, c_empty, ctx_ptr, bt_ptr, stride_bt,
                         req_lo, h, split, num_splits, req_hi, HQ, G, D, C, CTX_TILES)),
    ], [4, 4, 1, 1], [SYS_REGS_, CTX_REGS_, 24, 24])  # 24: WS_PRODUCER_REGS, the TMA warps'


def fused_relay_decode(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                       num_splits: int, tile: FusedTile, merge: MergeTile):
    """One decode step of relay attention, every request behind the one prefix: the fused
    kernel's partials (fused_relay_partials, whose arguments these are), then merge_partials
    with the plan's merge launch.

    Returns o [N, Hq, D] in q's dtype, and the launched kernel. The plan's merge is a
    programmatic dependent of the fused kernel, which does not trigger it, so its programs
    are placed as the fused kernel's last ones leave (the same bits). The fused kernel never
    triggers early: a trigger at program start would let the merge's programs take SM slots
    while the fused kernel's are still being placed. docs/kernels.md has the measurements.
    """
    o_part, lse_part, kernel = fused_relay_partials(q, k_sys, v_sys, k_cache, v_cache, block_tables, context_lens,
                                                    scale, num_splits, tile)
    return merge_partials(o_part, lse_part, q.dtype, merge, with_lse=False)[0], kernel


def fused_relay_partials(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         num_splits: int, tile: FusedTile):
    """The fused kernel alone: the partials of one decode step, unmerged.

    q [N, Hq, D] contiguous; k_sys/v_sys [S, Hkv, D] contiguous; k_cache/v_cache
    [num_blocks, C, Hkv, D] with C = 64 keys a block; block_tables [N, max_blocks] int32;
    context_lens [N] int32 (own keys; 0 for a padding row of a decode graph, whose own
    partial is then empty and whose table's first block is still read). Returns the fp32
    partials o [num_splits + 1, N, Hq, D] and lse [num_splits + 1, N, Hq] (the own keys' last),
    and the launched kernel.
    tile: block_n-key prefix tiles in `stages` slots; ctx_tiles slots of the own-key ring, a
    [64, D] K or V tile each (2 or more); q_smem: the prefix consumers hold Q in shared
    memory, not registers (for block_n 128); sys_regs, ctx_regs: the roles' registers.
    """
    n, hq, d = q.shape
    s_len, hkv, _ = k_sys.shape
    nb, c, _, _ = k_cache.shape
    g = hq // hkv
    block_n, stages, ctx_tiles = tile.block_n, tile.stages, tile.ctx_tiles
    assert q.is_contiguous() and k_sys.is_contiguous() and v_sys.is_contiguous(), "contiguous q and system KV"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert q.dtype in (torch.bfloat16, torch.float16) and d in (64, 128) and c == FUSED_CHUNK and 1 <= g <= QN.value
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    assert block_n in (64, 128) and stages >= 1 and ctx_tiles >= 2, "tiles and ring depths"
    assert block_tables.stride(1) == 1 and block_tables.shape[0] == n and context_lens.shape == (n,)
    assert 8 * tile.sys_regs + 4 * tile.ctx_regs + 4 * WS_PRODUCER_REGS <= 16 * LAUNCH_REGS, \
        "the partitions' registers exceed the launch's"
    elem = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    sys_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], elem)
    k_desc, v_desc = (TensorDescriptor.from_tensor(t.view(s_len, hkv * d), [block_n, d], sys_layout)
                      for t in (k_sys, v_sys))
    c_layout = gl.NVMMASharedLayout.get_default_for([c, d], elem)
    kc_desc, vc_desc = (TensorDescriptor.from_tensor(t.view(nb * c, hkv * d), [c, d], c_layout)
                        for t in (k_cache, v_cache))
    q_desc = TensorDescriptor.from_tensor(q.view(n * hq, d), [QN.value, d],
                                          gl.NVMMASharedLayout.get_default_for([QN.value, d], elem))
    # the prefix partials, then the own-key partial: [num_splits + 1, N, Hq, D] and [.., N, Hq], fp32
    o_part = torch.empty(num_splits + 1, n, hq, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(num_splits + 1, n, hq, dtype=torch.float32, device=q.device)
    per = triton.cdiv(triton.cdiv(max(s_len, 1), num_splits), block_n) * block_n
    grid = (triton.cdiv(n * g, 128), hkv, num_splits)
    kernel = _fused_kernel[grid](
        q, k_desc, v_desc, kc_desc, vc_desc, q_desc, context_lens, block_tables, o_part, lse_part,
        n, s_len, per, num_splits, scale * LOG2E, block_tables.stride(0),
        q.stride(0), q.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        HQ=hq, G=g, D=d, BLOCK_N=block_n, STAGES=stages, C=c, CTX_TILES=ctx_tiles,
        Q_SMEM=tile.q_smem, SYS_REGS_=tile.sys_regs, CTX_REGS_=tile.ctx_regs, num_warps=4,
        maxnreg=LAUNCH_REGS)
    return o_part, lse_part, kernel

"""Decode relay attention for Hopper with the own keys inside the warp-specialised system program.

Experiment (issue 5, twenty-second session). At llama3-8b heads the system step is bound by
the tensor cores and the own-key step by bytes, yet run as two kernels they take the sum of
their times: the warp-specialised system program holds an SM's whole register file, so no
context program runs beside it (docs/kernels.md). Here the program gets a third role: beside
the two prefix consumer warpgroups (kernels/gluon_system_attention.py's, under a lower
register cap) and their TMA warp, an own-key warpgroup with a TMA warp of its own attends the
own keys of the program's requests while the prefix consumers keep the tensor cores busy.

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
and one barrier per 128 keys), which made the own keys no longer the longer role at llama3
batch 256 (twenty-fourth session).

Result: the system partials at splits 0..num_splits-1 as the system kernel writes them, the
own-key partial of every (request, head) at split num_splits, then merge_partials. Work:
program (m, h, split) takes the own keys of the requests whose first query row is among its
128, ceil(m*128/G) + i, i = split, split + num_splits, ... (the twenty-third session found
that the first form, m*128/G + i for i < 128/G, left a request of no program where G does
not divide 128: at G = 3 request 84).

H200 (docs/kernels.md, twenty-second session): llama3-8b heads, 8,192 + 128 own keys,
77.3-78.6 us against the engine's plan's 109.9-110.1 at batch 256, 33.8-34.6 against
47.6-49.0 at batch 64. The engine's plan since the twenty-third session, for graphed decode
steps where triton_plan.fused_decode_plan says it pays (kernels/triton_ops.py), on 64-key
cache blocks; since the twenty-fourth, with 128-key prefix tiles and Q in shared memory
where triton_plan.fused_tile says (4+ row tiles a KV head): 72.6 us at llama3 batch 256.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents

from kernels.gluon_system_attention import (LOG2E, WS_PRODUCER_REGS, _acc_layout, _cta_barrier, _ws_consumer,
                                            _ws_producer, _ws_ring)
from kernels.triton_plan import FUSED_CHUNK
from kernels.triton_system_attention import merge_partials
QN = gl.constexpr(8)  # query rows of an own chunk's wgmma (its N): a request's G rows, padded
# Registers a thread: the program is 16 warps (the two TMA warps share a warpgroup), so the
# launch's cap is 128 (16 x 128 x 32 = 64K); then the prefix consumers get SYS_REGS (the
# system kernel's consumers at ws_regs=128: 64-key tiles fit there without spills, twentieth
# session), the own-key warpgroup CTX_REGS, the TMA warps 24: 8 x 176 + 4 x 136 + 4 x 24 = 2048.
LAUNCH_REGS = 128
SYS_REGS = 176
CTX_REGS = 136


@gluon.jit
def _num_items(req_base, req_end, split, num_splits, RPC: gl.constexpr):
    """Own-key items (requests) of a program: local i = split + k * num_splits < req_end - req_base."""
    local = gl.minimum(req_end - req_base, RPC)
    return gl.maximum(gl.cdiv(local - split, num_splits), 0)


@gluon.jit
def _num_chunks(ctx_ptr, req_base, split, num_splits, n_items, C: gl.constexpr, RPC: gl.constexpr,
                WARPS: gl.constexpr):
    """Own chunks of the items, their lengths read a lane each (a TMA warp has 24 registers:
    at G = 1, 128 lengths in one vector spilled)."""
    BLOCK: gl.constexpr = 32 * WARPS
    total = 0
    for b in gl.static_range(0, RPC, BLOCK):
        k = b + gl.arange(0, BLOCK, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
        lens = gl.load(ctx_ptr + req_base + split + k * num_splits, mask=k < n_items, other=0)
        total += gl.sum(gl.where(k < n_items, gl.maximum(gl.cdiv(lens, C), 1), 0), 0)
    return total


@gluon.jit
def _ctx_schedule(ctx_ptr, req_base, split, num_splits, req_end, G: gl.constexpr, C: gl.constexpr,
                  WARPS: gl.constexpr, CTX_MODE: gl.constexpr):
    """What both own-key roles walk: (items, chunks, the first item's length, the second's)."""
    n_items = _num_items(req_base, req_end, split, num_splits, (128 + G - 1) // G)
    total = _num_chunks(ctx_ptr, req_base, split, num_splits, n_items, C, (128 + G - 1) // G, WARPS)
    if CTX_MODE == 2:  # timing only: no own keys (the result is incomplete)
        total = 0
    return (n_items, total, gl.load(ctx_ptr + req_base + split, mask=n_items > 0, other=0),
            gl.load(ctx_ptr + req_base + split + num_splits, mask=n_items > 1, other=0))


@gluon.jit
def _next_chunk(it_k, it_c, it_len, nx_len, n_items, ctx_ptr, req_base, split, num_splits, C: gl.constexpr,
                AHEAD: gl.constexpr):
    """Past one chunk of item it_k: the next chunk, in the next item after the last one.
    AHEAD (the own-key warpgroup): nx_len, the next item's length, is read an item ahead, so
    no load latency sits between one item's last chunk and the next one's first; the TMA
    warp (24 registers) reads it when it gets there, behind its slot waits."""
    it_c += 1
    if it_c * C >= it_len:
        it_k += 1
        it_c = 0
        if AHEAD:
            it_len = nx_len
            nx_len = gl.load(ctx_ptr + req_base + split + (it_k + 1) * num_splits, mask=it_k + 1 < n_items, other=0)
        else:
            it_len = gl.load(ctx_ptr + req_base + split + it_k * num_splits, mask=it_k < n_items, other=0)
    return it_k, it_c, it_len, nx_len


@gluon.constexpr_function
def _q_slots(ctx_tiles):
    """Q slots of the own-key ring: chunk c's Q comes with its K (tile 2c), which waits for tile
    2c - ctx_tiles to be done; the Q slot it takes was chunk (c - slots)'s, whose scores (tile
    2(c - slots)) must be done by then, so slots >= ctx_tiles / 2."""
    return (ctx_tiles + 1) // 2


@gluon.jit
def _ctx_consumer(cr_smem, qc_smem, pc_smem, c_ready, c_empty, ctx_ptr, o_ptr, lse_ptr,
                  req_base, h, split, num_splits, req_end, qk_scale,
                  stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                  G: gl.constexpr, D: gl.constexpr, C: gl.constexpr, CTX_TILES: gl.constexpr,
                  CTX_MODE: gl.constexpr):
    """The own-key warpgroup: every chunk of the program's items, in order. The ring holds
    [C, D] tiles in the order they are used, K_0, V_0, K_1, V_1, ...: tile t in slot
    t % CTX_TILES, free again once the wgmma that reads it is done, so a chunk's K slot takes
    the next tile while the chunk's P V still runs (chunk c's Q rows: slot c % _q_slots)."""
    dtype: gl.constexpr = cr_smem.dtype
    st_layout: gl.constexpr = _acc_layout(QN, 4)  # [C, 8] and [D, 8] accumulators, one warpgroup
    col_l: gl.constexpr = gl.SliceLayout(0, st_layout)
    key_l: gl.constexpr = gl.SliceLayout(1, st_layout)
    n_items, total, it_len, nx_len = _ctx_schedule(ctx_ptr, req_base, split, num_splits, req_end, G, C, 4, CTX_MODE)
    it_k = n_items * 0
    it_c = n_items * 0
    m_c = gl.full([QN], -1.0e30, gl.float32, layout=col_l)
    l_c = gl.zeros([QN], gl.float32, layout=col_l)
    o_c = gl.zeros([D, QN], gl.float32, layout=st_layout)
    cols = gl.arange(0, QN, layout=col_l)
    dims = gl.arange(0, D, layout=key_l)
    c = total * 0
    while c < total:
        # Two chunks of one item a step where the item has them: one cross-warp max and sum
        # and one barrier per 128 keys (the keys are the wgmma's M, spread over the 4 warps)
        pair = (c + 1 < total) & ((it_c + 1) * C < it_len)
        s0 = _own_scores(cr_smem, qc_smem, c_ready, c_empty, c, st_layout, C, CTX_TILES)
        s0 = gl.where(gl.expand_dims(it_c * C + gl.arange(0, C, layout=key_l) < it_len, 1), s0 * qk_scale,
                      float("-inf"))
        if pair:
            s1 = _own_scores(cr_smem, qc_smem, c_ready, c_empty, c + 1, st_layout, C, CTX_TILES)
            s1 = gl.where(gl.expand_dims((it_c + 1) * C + gl.arange(0, C, layout=key_l) < it_len, 1),
                          s1 * qk_scale, float("-inf"))
        else:
            s1 = gl.full([C, QN], float("-inf"), gl.float32, layout=st_layout)
        m_new = gl.maximum(m_c, gl.max(gl.maximum(s0, s1), 0))
        alpha = gl.exp2(m_c - m_new)
        p0 = gl.exp2(s0 - gl.expand_dims(m_new, 0))
        p1 = gl.exp2(s1 - gl.expand_dims(m_new, 0))
        l_c = l_c * alpha + gl.sum(p0 + p1, 0)
        m_c = m_new
        pc_smem.index(0).store(gl.permute(p0.to(dtype), [1, 0]))
        pc_smem.index(1).store(gl.permute(p1.to(dtype), [1, 0]))
        fence_async_shared()
        _cta_barrier()  # every thread's P rows are in shared memory before the wgmma reads them
        o_c = _own_pv(cr_smem, pc_smem.index(0), c_ready, c_empty, c, o_c * gl.expand_dims(alpha, 0), CTX_TILES)
        if pair:
            o_c = _own_pv(cr_smem, pc_smem.index(1), c_ready, c_empty, c + 1, o_c, CTX_TILES)
            it_k, it_c, it_len, nx_len = _next_chunk(it_k, it_c, it_len, nx_len, n_items, ctx_ptr, req_base, split,
                                                 num_splits, C, True)
            c += 1
        if (it_c + 1) * C >= it_len:  # the item's last chunk: its partial out
            n = req_base + split + it_k * num_splits
            o = o_c / gl.expand_dims(gl.where(l_c == 0.0, 1.0, l_c), 0)
            lse = gl.where(l_c == 0.0, float("-inf"),
                           (m_c + gl.log2(gl.where(l_c == 0.0, 1.0, l_c))) * 0.6931471805599453)
            base = num_splits * stride_os + n * stride_on
            ptrs = o_ptr + base + gl.expand_dims((h * G + cols) * stride_oh, 0) + gl.expand_dims(dims, 1)
            gl.store(ptrs, o, mask=gl.expand_dims(cols < G, 0))
            gl.store(lse_ptr + num_splits * stride_ls + n * stride_ln + h * G + cols, lse, mask=cols < G)
            m_c = gl.full([QN], -1.0e30, gl.float32, layout=col_l)
            l_c = gl.zeros([QN], gl.float32, layout=col_l)
            o_c = gl.zeros([D, QN], gl.float32, layout=st_layout)
        it_k, it_c, it_len, nx_len = _next_chunk(it_k, it_c, it_len, nx_len, n_items, ctx_ptr, req_base, split,
                                                 num_splits, C, True)
        c += 1


@gluon.jit
def _own_scores(cr_smem, qc_smem, c_ready, c_empty, c, st_layout: gl.constexpr, C: gl.constexpr,
                CTX_TILES: gl.constexpr):
    """S^T [C, 8] of chunk c (its K: ring tile 2c); the K slot is free once this returns."""
    tk = 2 * c
    mbarrier.wait(c_ready.index(tk % CTX_TILES), (tk // CTX_TILES) & 1)
    s_tok = warpgroup_mma(cr_smem.index(tk % CTX_TILES), qc_smem.index(c % _q_slots(CTX_TILES)).permute((1, 0)),
                          gl.zeros([C, QN], gl.float32, layout=st_layout), use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(c_empty.index(tk % CTX_TILES), count=1)
    return s


@gluon.jit
def _own_pv(cr_smem, p_smem, c_ready, c_empty, c, o_c, CTX_TILES: gl.constexpr):
    """O^T += V_c^T P^T for chunk c (its V: ring tile 2c + 1), then the V slot is free."""
    tv = 2 * c + 1
    mbarrier.wait(c_ready.index(tv % CTX_TILES), (tv // CTX_TILES) & 1)
    o_tok = warpgroup_mma(cr_smem.index(tv % CTX_TILES).permute((1, 0)), p_smem.permute((1, 0)), o_c, is_async=True)
    o_c = warpgroup_mma_wait(0, deps=[o_tok])
    mbarrier.arrive(c_empty.index(tv % CTX_TILES), count=1)
    return o_c


@gluon.jit
def _ctx_producer(kc_desc, vc_desc, q_desc, cr_smem, qc_smem, c_ready, c_empty, ctx_ptr, bt_ptr, stride_bt,
                  req_base, h, split, num_splits, req_end,
                  HQ: gl.constexpr, G: gl.constexpr, D: gl.constexpr, C: gl.constexpr, CTX_TILES: gl.constexpr,
                  CTX_MODE: gl.constexpr):
    """The own-key TMA warp: chunk c's K and V block and Q rows as soon as its slot is free.
    The next chunk's cache block is read one chunk ahead, so no load latency sits in front
    of a TMA."""
    n_items, total, it_len, nx_len = _ctx_schedule(ctx_ptr, req_base, split, num_splits, req_end, G, C, 1, CTX_MODE)
    it_k = n_items * 0
    it_c = n_items * 0
    blk = gl.load(bt_ptr + (req_base + split) * stride_bt, mask=n_items > 0, other=0)
    for c in range(total):
        n = req_base + split + it_k * num_splits
        tk = 2 * c
        sk = tk % CTX_TILES
        mbarrier.wait(c_empty.index(sk), ((tk // CTX_TILES) & 1) ^ 1)
        mbarrier.expect(c_ready.index(sk), kc_desc.block_type.nbytes + q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kc_desc, [blk * C, h * D], c_ready.index(sk), cr_smem.index(sk))
        tma.async_copy_global_to_shared(q_desc, [n * HQ + h * G, 0], c_ready.index(sk),
                                        qc_smem.index(c % _q_slots(CTX_TILES)))
        sv = (tk + 1) % CTX_TILES
        mbarrier.wait(c_empty.index(sv), (((tk + 1) // CTX_TILES) & 1) ^ 1)
        mbarrier.expect(c_ready.index(sv), vc_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(vc_desc, [blk * C, h * D], c_ready.index(sv), cr_smem.index(sv))
        it_k, it_c, it_len, nx_len = _next_chunk(it_k, it_c, it_len, nx_len, n_items, ctx_ptr, req_base, split,
                                                 num_splits, C, False)
        blk = gl.load(bt_ptr + (req_base + split + it_k * num_splits) * stride_bt + it_c, mask=it_k < n_items,
                      other=0)


@gluon.jit(do_not_specialize=["n_queries", "keys_per_split", "num_splits"])
def _fused_kernel(q_ptr, k_desc, v_desc, kc_desc, vc_desc, q_desc, ctx_ptr, bt_ptr, o_ptr, lse_ptr,
                  n_queries, seq_len, keys_per_split, num_splits, qk_scale, stride_bt,
                  stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                  HQ: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, C: gl.constexpr, CTX_TILES: gl.constexpr,
                  Q_SMEM: gl.constexpr, SYS_REGS_: gl.constexpr, CTX_REGS_: gl.constexpr, CTX_MODE: gl.constexpr,
                  TRIGGER: gl.constexpr):
    """grid (cdiv(n*G, 128), Hkv, num_splits); 4 warps (the first prefix consumer) + a second
    prefix consumer, the own-key warpgroup and two TMA warps."""
    if TRIGGER:  # the merge kernel, a programmatic dependent, may be placed now (it waits)
        gdc_launch_dependents()
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
                         stride_os, stride_on, stride_oh, stride_ls, stride_ln, G, D, C, CTX_TILES, CTX_MODE)),
        (_ws_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lo, num_tiles, col,
                        STAGES, BLOCK_N)),
        (_ctx_producer, (kc_desc, vc_desc, q_desc, cr, qc, c_ready, c_empty, ctx_ptr, bt_ptr, stride_bt,
                         req_lo, h, split, num_splits, req_hi, HQ, G, D, C, CTX_TILES, CTX_MODE)),
    ], [4, 4, 1, 1], [SYS_REGS_, CTX_REGS_, 24, 24])  # 24: WS_PRODUCER_REGS, the TMA warps'


def fused_relay_decode(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                       num_splits: int, block_n: int = 64, stages: int = 3, ctx_tiles: int = 4,
                       launch_regs: int = LAUNCH_REGS, sys_regs: int = SYS_REGS, ctx_regs: int = CTX_REGS,
                       ctx_mode: int = 0, q_smem: bool = False,
                       pdl_merge: bool = False, merge_unroll: int | None = None):
    """One decode step of relay attention, every request behind the one prefix.

    q [N, Hq, D] contiguous; k_sys/v_sys [S, Hkv, D] contiguous; k_cache/v_cache
    [num_blocks, C, Hkv, D] with C = 64 keys a block; block_tables [N, max_blocks] int32;
    context_lens [N] int32 (own keys; 0 for a padding row of a decode graph, whose own
    partial is then empty and whose table's first block is still read). Returns o [N, Hq, D]
    in q's dtype, and the launched kernel.
    ctx_mode: 0 the own keys in their warpgroup, 2 none (timing only: the result lacks them).
    ctx_tiles: slots of the own-key ring, a [64, D] K or V tile each (2 or more).
    q_smem: the prefix consumers hold Q in shared memory, not registers (for block_n 128).
    pdl_merge: the merge kernel is launched as a programmatic dependent (sm_90), so its
    launch overlaps this kernel's tail; it waits for this kernel before reading.
    merge_unroll: the merge kernel's partials in flight at once (the same bits for any).
    """
    n, hq, d = q.shape
    s_len, hkv, _ = k_sys.shape
    nb, c, _, _ = k_cache.shape
    g = hq // hkv
    assert q.is_contiguous() and k_sys.is_contiguous() and v_sys.is_contiguous(), "contiguous q and system KV"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert q.dtype in (torch.bfloat16, torch.float16) and d in (64, 128) and c == FUSED_CHUNK and 1 <= g <= QN.value
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32 and ctx_mode in (0, 2)
    assert block_n in (64, 128) and stages >= 1 and ctx_tiles >= 2, "tiles and ring depths"
    assert block_tables.stride(1) == 1 and block_tables.shape[0] == n and context_lens.shape == (n,)
    assert 16 * launch_regs * 32 <= 65536 and 8 * sys_regs + 4 * ctx_regs + 4 * WS_PRODUCER_REGS <= 16 * launch_regs, \
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
        Q_SMEM=q_smem, SYS_REGS_=sys_regs, CTX_REGS_=ctx_regs, CTX_MODE=ctx_mode, TRIGGER=pdl_merge, num_warps=4,
        maxnreg=launch_regs)
    return merge_partials(o_part, lse_part, q.dtype, with_lse=False, pdl=pdl_merge, unroll=merge_unroll)[0], kernel

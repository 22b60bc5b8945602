"""System attention for Hopper in Gluon: the Triton kernel's job with the softmax overlapped.

Same contract as `system_attention_into` in triton_system_attention.py (the [n*G, D]
query matrix of one KV head against one chunk of the shared prefix, fp32 partials out),
for bf16/fp16 on sm_90. Plain Triton waits for every wgmma at once except an
accumulator carried into the next iteration, so a tile's exponentials never run beside
the tensor cores (docs/kernels.md). Gluon issues and waits for each wgmma explicitly,
which allows the schedule FlashAttention-3 calls intra-warpgroup pipelining:

    iteration j:  S_j = Q K_j^T (async)   O += P_{j-1} V_{j-1} (async)
                  wait until only the P V is in flight -> S_j
                  softmax of S_j (max, exp2, sums)        <- tensor cores busy with P V
                  wait for P V; rescale O to the new max

K and V tiles arrive by TMA into a ring of STAGES slots, each with its own mbarrier; a
slot is refilled as soon as the wgmma that read it has completed.

WS=True is the warp-specialised program for full batches (tiles.WS_TILE): two such
consumer warpgroups of 64 rows share every K/V tile, and a producer warp issues the TMA.
Both programs run one body, `_attend`.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from relaycli.kernels.triton_plan import is_sm90

# Triton 3.6 names the CTA barrier thread_barrier, later releases barrier
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
LOG2E = 1.4426950408889634
WS_BLOCK_M = 128  # query rows of a warp-specialised program: two consumer warpgroups of 64
WS_REGS = 168  # its launch's register cap: 12 warps x 168 x 32 threads fill an SM's 64K registers
WS_PRODUCER_REGS = 24


def ws_consumer_regs(ws_regs: int) -> int:
    """Registers a thread of each consumer warpgroup gets when the launch is capped at ws_regs:
    the 12 warps' share less the producer warpgroup's, halved, in steps of 8 (setmaxnreg's)."""
    assert 24 <= ws_regs <= 255, f"ws_regs must be 24..255, got {ws_regs}"
    return min(240, (12 * ws_regs - 4 * WS_PRODUCER_REGS) // 8 // 8 * 8)


@gluon.jit
def _mask_tail(s, start, hi, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Scores of keys at or past hi (a chunk's ragged end) -> -inf."""
    cols = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.where(gl.expand_dims(cols < hi, 0), s, float("-inf"))


@gluon.jit
def _load_kv(desc, smem, bars, tile, lo, col, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, pred):
    """TMA of key tile `tile` (counted from lo) into its ring slot; pred False issues nothing."""
    slot = tile % STAGES
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [lo + tile * BLOCK_N, col], bars.index(slot), smem.index(slot), pred=pred)


@gluon.jit
def _slot_read(desc, smem, ready, empty, tile, lo, col, num_tiles, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
               SELF_LOAD: gl.constexpr):
    """The wgmma reading tile `tile`'s K (or V) slot has finished: refill the slot with tile
    + STAGES (SELF_LOAD: this warpgroup is its own producer), or tell the producer warp."""
    if SELF_LOAD:
        _load_kv(desc, smem, ready, tile + STAGES, lo, col, STAGES, BLOCK_N, tile + STAGES < num_tiles)
    else:
        mbarrier.arrive(empty.index(tile % STAGES), count=1)


@gluon.constexpr_function
def _acc_layout(cols, warps):
    """wgmma accumulator layout of [rows, cols] fp32: one warpgroup per 64 rows, [16, cols, 16]
    instructions (cols: BLOCK_N for S, D for O)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _q_rows(q_ptr, rows_ptr, row0, h, n_queries, stride_qn, stride_qh, G: gl.constexpr, D: gl.constexpr,
            BLOCK_M: gl.constexpr, HAS_ROWS: gl.constexpr, WARPS: gl.constexpr):
    """Query rows row0.. of KV head h, [BLOCK_M, D] in a blocked layout (rows past the batch 0)."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    r = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
    n = r // G
    rmask = n < n_queries
    if HAS_ROWS:  # a prefix group: its queries are scattered rows of the packed batch
        row = gl.load(rows_ptr + n, mask=rmask, other=0)
    else:
        row = n
    head = h * G + r % G
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    return gl.load(q_ptr + gl.expand_dims(row * stride_qn + head * stride_qh, 1) + gl.expand_dims(offs_d, 0),
                   mask=gl.expand_dims(rmask, 1), other=0.0)


@gluon.jit
def _load_q(q_ptr, rows_ptr, row0, h, n_queries, stride_qn, stride_qh, G: gl.constexpr, D: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_ROWS: gl.constexpr, WARPS: gl.constexpr):
    """Query rows row0.. of KV head h as the A operand of the S wgmma, [BLOCK_M, D]."""
    # Q [BLOCK_M, D] stays in registers as the A operand of every S wgmma, so shared memory
    # serves only K and V (faster than Q from shared memory at full batches: measured on the
    # H200; docs/kernels.md has the numbers).
    q = _q_rows(q_ptr, rows_ptr, row0, h, n_queries, stride_qn, stride_qh, G, D, BLOCK_M, HAS_ROWS, WARPS)
    return gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=_acc_layout(BLOCK_N, WARPS), k_width=2))


@gluon.jit
def _attend(q_op, rows_ptr, o_ptr, lse_ptr, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
            row0, h, split, n_queries, lo, hi, num_tiles, col, qk_scale,
            stride_os, stride_on, stride_oh, stride_ls, stride_ln,
            G: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, HAS_ROWS: gl.constexpr, WARPS: gl.constexpr, SELF_LOAD: gl.constexpr):
    """q_op's BLOCK_M rows (WARPS // 4 warpgroups) against the chunk [lo, hi) of one KV head,
    the normalised fp32 partial and its lse stored at split.

    SELF_LOAD: these warps issue the K/V TMA themselves (k_empty/v_empty unused); else a
    producer partition does, waiting on k_empty/v_empty, and every tile must be consumed,
    rows past the batch included, since the producer counts the consumers' arrivals.
    """
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, WARPS)
    o_layout: gl.constexpr = _acc_layout(D, WARPS)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if SELF_LOAD:
        for i in gl.static_range(STAGES):
            _load_kv(k_desc, k_smem, k_ready, i, lo, col, STAGES, BLOCK_N, i < num_tiles)
            _load_kv(v_desc, v_smem, v_ready, i, lo, col, STAGES, BLOCK_N, i < num_tiles)

    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    if num_tiles > 0:
        # Tile 0: scores, softmax; its P V is issued in the first iteration.
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        _slot_read(k_desc, k_smem, k_ready, k_empty, 0, lo, col, num_tiles, STAGES, BLOCK_N, SELF_LOAD)
        if BLOCK_N > hi - lo:
            s = _mask_tail(s, lo, hi, BLOCK_N, s_layout)
        m_i = gl.max(s, 1) * qk_scale
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))
        l_i = gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, num_tiles):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_tok])  # S_j done; P_{j-1} V_{j-1} may still run
            _slot_read(k_desc, k_smem, k_ready, k_empty, j, lo, col, num_tiles, STAGES, BLOCK_N, SELF_LOAD)
            start = lo + j * BLOCK_N
            if start + BLOCK_N > hi:
                s = _mask_tail(s, start, hi, BLOCK_N, s_layout)
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
            _slot_read(v_desc, v_smem, v_ready, v_empty, j - 1, lo, col, num_tiles, STAGES, BLOCK_N, SELF_LOAD)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = (num_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((num_tiles - 1) // STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=[acc_tok, p_op])
        if not SELF_LOAD:
            mbarrier.arrive(v_empty.index(last), count=1)
    if SELF_LOAD:
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))

    # o = acc / l and lse (natural log); a chunk without keys gives (0, -inf).
    l_o = gl.convert_layout(l_i, row_o)
    empty = l_o == 0.0
    o = acc / gl.expand_dims(gl.where(empty, 1.0, l_o), 1)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453)
    r_o = row0 + gl.arange(0, BLOCK_M, layout=row_o)
    n_o = r_o // G
    omask = n_o < n_queries
    if HAS_ROWS:
        row_out = gl.load(rows_ptr + n_o, mask=omask, other=0)
    else:
        row_out = n_o
    o_off = split * stride_os + row_out * stride_on + (h * G + r_o % G) * stride_oh
    offs_do = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(offs_do, 0), o.to(o_ptr.dtype.element_ty),
             mask=gl.expand_dims(omask, 1))
    lse_o = gl.convert_layout(lse, row_o)
    gl.store(lse_ptr + split * stride_ls + row_out * stride_ln + h * G + r_o % G, lse_o, mask=omask)


# Warp-specialised variant (FlashAttention-3's layout): one program holds 2 x 64 query rows
# in two consumer warpgroups that share every K/V tile, and a one-warp producer that only
# issues TMA. K/V slots carry a "ready" barrier (the producer's TMA completes it) and an
# "empty" one (both consumers arrive once the wgmma reading the slot has finished).


@gluon.jit
def _ws_ring(k_desc, v_desc, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """The K/V ring of a warp-specialised program: STAGES slots of each, a "ready" barrier
    a slot (the TMA completes it) and an "empty" one (both consumers arrive)."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    return k_smem, v_smem, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def _ws_producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lo, num_tiles, col,
                 STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    for j in range(num_tiles):
        slot = j % STAGES
        # A fresh mbarrier counts as having completed the phase before 0, so the first
        # STAGES waits pass at once.
        free_phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free_phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [lo + j * BLOCK_N, col], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free_phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [lo + j * BLOCK_N, col], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _ws_consumer(q_ptr, rows_ptr, o_ptr, lse_ptr, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                 row0, h, split, n_queries, lo, hi, num_tiles, col, qk_scale,
                 stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                 G: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 HAS_ROWS: gl.constexpr, Q_SMEM: gl.constexpr, q_smem):
    """One consumer warpgroup: 64 query rows from row0, fed by the producer.

    Q_SMEM: q_smem, a [64, D] shared buffer of this warpgroup's own, holds Q as the S
    wgmma's A operand instead of 32 registers a thread (what 128-key tiles need beside the
    fused kernel's own-key warpgroup); else Q stays in registers and q_smem is unused."""
    if not Q_SMEM:
        q_op = _load_q(q_ptr, rows_ptr, row0, h, n_queries, stride_qn, stride_qh, G, D, 64, BLOCK_N, HAS_ROWS, 4)
    else:
        q_smem.store(_q_rows(q_ptr, rows_ptr, row0, h, n_queries, stride_qn, stride_qh, G, D, 64, HAS_ROWS, 4))
        fence_async_shared()
        _cta_barrier()  # the warpgroup's rows are all in shared memory before its first wgmma
        q_op = q_smem
    _attend(q_op, rows_ptr, o_ptr, lse_ptr, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
            row0, h, split, n_queries, lo, hi, num_tiles, col, qk_scale,
            stride_os, stride_on, stride_oh, stride_ls, stride_ln, G, D, 64, BLOCK_N, STAGES, HAS_ROWS, 4, False)


@gluon.jit(do_not_specialize=["n_queries", "keys_per_split"])
def _gluon_system_kernel(q_ptr, k_desc, v_desc, rows_ptr, o_ptr, lse_ptr,
                         n_queries, seq_len, keys_per_split, qk_scale,
                         stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                         G: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         STAGES: gl.constexpr, HAS_ROWS: gl.constexpr, WS: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """grid (cdiv(n*G, BLOCK_M), Hkv, splits).

    WS False: every warp computes, and the warps issue their own TMA. WS True (BLOCK_M 128,
    num_warps 4): the warp-specialised program, these 4 warps the first consumer, plus a
    second consumer warpgroup and the producer warp as workers.
    """
    pid_m = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    dtype: gl.constexpr = k_desc.dtype
    if WS:
        gl.static_assert(num_warps == 4 and BLOCK_M == 128, "two consumer warpgroups of 64 rows")
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = _ws_ring(k_desc, v_desc, STAGES, BLOCK_N, D)
        lo = split * keys_per_split
        hi = gl.minimum(lo + keys_per_split, seq_len)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        col = h * D
        row0 = pid_m * BLOCK_M
        # Tuples written out whole: constexprs keep their kind only as literal members.
        # Registers: the launch's cap (ws_regs) times 12 warps is the program's share of the
        # register file; the producer keeps 24 and the consumers split the rest
        # (ws_consumer_regs: 240 each at the default cap of 168, which fills the file).
        gl.warp_specialize([
            (_ws_consumer, (q_ptr, rows_ptr, o_ptr, lse_ptr, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready,
                            k_empty, v_empty, row0, h, split, n_queries, lo, hi, num_tiles, col, qk_scale,
                            stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                            G, D, BLOCK_N, STAGES, HAS_ROWS, False, k_smem)),
            (_ws_consumer, (q_ptr, rows_ptr, o_ptr, lse_ptr, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready,
                            k_empty, v_empty, row0 + 64, h, split, n_queries, lo, hi, num_tiles, col, qk_scale,
                            stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                            G, D, BLOCK_N, STAGES, HAS_ROWS, False, k_smem)),
            (_ws_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lo, num_tiles, col,
                            STAGES, BLOCK_N)),
        ], [4, 1], [CONSUMER_REGS, 24])  # 24: WS_PRODUCER_REGS, which ws_consumer_regs leaves it
    else:
        # Q first: its layout conversion's scratch is then free again for the K/V ring (8-16
        # KiB less shared memory a program, which the context programs beside it can use)
        q_op = _load_q(q_ptr, rows_ptr, pid_m * BLOCK_M, h, n_queries, stride_qn, stride_qh, G, D, BLOCK_M,
                       BLOCK_N, HAS_ROWS, num_warps)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        lo = split * keys_per_split
        hi = gl.minimum(lo + keys_per_split, seq_len)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        _attend(q_op, rows_ptr, o_ptr, lse_ptr, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, k_bars, v_bars,
                pid_m * BLOCK_M, h, split, n_queries, lo, hi, num_tiles, h * D, qk_scale,
                stride_os, stride_on, stride_oh, stride_ls, stride_ln, G, D, BLOCK_M, BLOCK_N, STAGES, HAS_ROWS,
                num_warps, True)


def gluon_ok(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Hopper (sm_90, not ROCm), 16-bit inputs, head dim 64 or 128, a non-empty [S, Hkv*D] view TMA can address."""
    if not is_sm90(q.device):
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128) and kv.is_contiguous()
            and kv.shape[0] > 0 and kv.data_ptr() % 16 == 0)


def gluon_system_attention_into(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, scale: float,
                                o_part: torch.Tensor, lse_part: torch.Tensor, rows: torch.Tensor | None,
                                num_splits: int, block_m: int = 64, block_n: int = 64, stages: int = 3,
                                ws: bool = False):
    """q [N, Hq, D]; k_sys/v_sys [S, Hkv, D] contiguous; o_part [splits, N, Hq, D]; lse_part [splits, N, Hq].

    ws: the warp-specialised kernel (block_m 128: two consumer warpgroups and a TMA warp),
    its launch capped at WS_REGS registers a thread: it claims a whole SM's register file.
    Returns the launched kernel (its n_regs and n_spills tell whether the cap holds).
    The caller (system_attention_into) has checked shapes; this checks what only the Gluon
    kernels need.
    """
    assert gluon_ok(q, k_sys) and gluon_ok(q, v_sys), "needs sm_90, 16-bit, head dim 64/128, TMA-addressable KV"
    assert block_m == WS_BLOCK_M if ws else block_m % 64 == 0, "one warpgroup per 64 rows; ws takes 128"
    seq_len, hkv, d = k_sys.shape
    group = q.shape[1] // hkv
    n_q = q.shape[0] if rows is None else rows.shape[0]
    if n_q == 0:
        return
    elem = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], elem)
    k_desc, v_desc = (TensorDescriptor.from_tensor(t.view(seq_len, hkv * d), [block_n, d], layout)
                      for t in (k_sys, v_sys))
    per = triton.cdiv(triton.cdiv(max(seq_len, 1), num_splits), block_n) * block_n
    grid = (triton.cdiv(n_q * group, block_m), hkv, num_splits)
    args = (q, k_desc, v_desc, rows if rows is not None else q, o_part, lse_part, n_q, seq_len, per, scale * LOG2E,
            q.stride(0), q.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1))
    # the warp-specialised program's register split needs the launch capped (12 warps)
    extra = dict(maxnreg=WS_REGS) if ws else {}
    return _gluon_system_kernel[grid](*args, G=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
                                      HAS_ROWS=rows is not None, WS=ws,
                                      CONSUMER_REGS=ws_consumer_regs(WS_REGS), num_warps=4 if ws else block_m // 16,
                                      **extra)

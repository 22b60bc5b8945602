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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.gluon_own_keys import QN, _ctx_consumer, _ctx_producer, _q_slots
from kernels.gluon_system_attention import LOG2E, WS_PRODUCER_REGS, _ws_consumer, _ws_producer, _ws_ring
from kernels.triton_plan import FUSED_CHUNK, num_sms
from kernels.triton_system_attention import merge_partials

# Registers a thread: the program is 16 warps (the two TMA warps share a warpgroup), so the
# launch's cap is 128 (16 x 128 x 32 = 64K); then the prefix consumers get SYS_REGS (the
# system kernel's consumers at ws_regs=128: 64-key tiles fit there without spills, twentieth
# session), the own-key warpgroup CTX_REGS, the TMA warps 24: 8 x 176 + 4 x 136 + 4 x 24 = 2048.
LAUNCH_REGS = 128
SYS_REGS = 176
CTX_REGS = 136


@gluon.jit
def _stamp(dbg_ptr, k: gl.constexpr):
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [gl.program_id(0)], dtype=gl.int64,
                                  is_pure=False, pack=1)
    lin = (gl.program_id(2) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(0) + gl.program_id(0)
    gl.store(dbg_ptr + lin * 8 + k, t)


@gluon.jit
def _merge_group(o_ptr, lse_ptr, out_ptr, cnt_ptr, row0, h, split, num_splits, n_queries,
                 stride_os, stride_on, stride_oh, stride_ls, stride_ln, stride_outn, stride_outh,
                 G: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr, PARTS: gl.constexpr, dbg_ptr,
                 PROBE: gl.constexpr):
    """The merge kernel's work for this program's row tile, done by the programs that wrote it.

    The num_splits programs of a row tile (one per split) each announce their partials on the
    tile's counter, wait until all have, then merge every ROWS-row block from `split` on over
    the PARTS = num_splits + 1 partials (the own keys' last) and write o. No program can wait
    on one that has not started: the launch is cooperative, so every program is resident.
    The last program to finish sets the counter back to 0 for the next launch (a CUDA graph
    replays the same buffer).

    A block is one round of loads: every partial's lse and o are loaded before any is needed
    (a fold partial by partial, as merge_partials does, waits an L2 round trip for each:
    6-19 us a program on the H200), then o = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max).
    """
    if PROBE:
        _stamp(dbg_ptr, 1)
    # Release after the join: every partition's partial stores happen before the count rises.
    gl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    if PROBE:
        _stamp(dbg_ptr, 2)
    seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < num_splits:
        seen = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    if PROBE:
        _stamp(dbg_ptr, 3)
    layout: gl.constexpr = gl.BlockedLayout([1, D // 32], [1, 32], [4, 1], [1, 0])
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    offs_d = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, layout)), 0)
    for blk in range(split, 128 // ROWS, num_splits):
        r = row0 + blk * ROWS + gl.arange(0, ROWS, layout=row_l)
        n = r // G
        head = h * G + r % G
        rmask = n < n_queries
        o_off = gl.expand_dims(n * stride_on + head * stride_oh, 1) + offs_d
        lse_off = n * stride_ln + head
        o_parts = ()
        lse_parts = ()
        for s in gl.static_range(PARTS):
            lse_parts = lse_parts + (gl.load(lse_ptr + s * stride_ls + lse_off, mask=rmask, other=float("-inf")),)
            o_parts = o_parts + (gl.load(o_ptr + s * stride_os + o_off, mask=gl.expand_dims(rmask, 1), other=0.0),)
        m = lse_parts[0]
        for s in gl.static_range(1, PARTS):
            m = gl.maximum(m, lse_parts[s])
        m = gl.where(m == float("-inf"), 0.0, m)  # no keys in any partial: o = 0
        acc = gl.zeros([ROWS, D], gl.float32, layout)
        den = gl.zeros([ROWS], gl.float32, row_l)
        for s in gl.static_range(PARTS):
            w = gl.exp(lse_parts[s] - m)
            w2 = gl.expand_dims(w, 1)
            acc += gl.where(w2 > 0, o_parts[s] * w2, 0.0)  # a partial without keys may hold anything
            den += w
        safe = gl.where(den == 0.0, 1.0, den)
        out_off = gl.expand_dims(n * stride_outn + head * stride_outh, 1) + offs_d
        gl.store(out_ptr + out_off, (acc / gl.expand_dims(safe, 1)).to(out_ptr.dtype.element_ty),
                 mask=gl.expand_dims(rmask, 1))
    if PROBE:
        _stamp(dbg_ptr, 4)
    # Every program increments once more after its wait: the one that sees 2 * num_splits - 1
    # is the last, and no program still reads the counter.
    done = gl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
    if done == 2 * num_splits - 1:
        gl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@gluon.jit(do_not_specialize=["n_queries", "keys_per_split", "num_splits"])
def _fused_kernel(q_ptr, k_desc, v_desc, kc_desc, vc_desc, q_desc, ctx_ptr, bt_ptr, o_ptr, lse_ptr,
                  out_ptr, cnt_ptr, n_queries, seq_len, keys_per_split, num_splits, qk_scale, stride_bt,
                  stride_qn, stride_qh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                  stride_outn, stride_outh,
                  HQ: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, C: gl.constexpr, CTX_TILES: gl.constexpr,
                  Q_SMEM: gl.constexpr, SYS_REGS_: gl.constexpr, CTX_REGS_: gl.constexpr, CTX_MODE: gl.constexpr,
                  MERGE: gl.constexpr, ROWS: gl.constexpr, PARTS: gl.constexpr, dbg_ptr, PROBE: gl.constexpr):
    """grid (cdiv(n*G, 128), Hkv, num_splits); 4 warps (the first prefix consumer) + a second
    prefix consumer, the own-key warpgroup and two TMA warps. MERGE: the programs of a row tile
    then merge its partials into out (_merge_group; a cooperative launch)."""
    if PROBE:
        _stamp(dbg_ptr, 0)
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
    if PROBE:
        _stamp(dbg_ptr, 6)
    if MERGE:  # the default partition's 4 warps, after every partition has joined; the program
        # ids again, not values held across the partitions (their registers are spoken for)
        pid_m = gl.program_id(0)
        h = gl.program_id(1)
        split = gl.program_id(2)
        _merge_group(o_ptr, lse_ptr, out_ptr, cnt_ptr + pid_m * gl.num_programs(1) + h, pid_m * 128, h, split,
                     num_splits,
                     n_queries, stride_os, stride_on, stride_oh, stride_ls, stride_ln, stride_outn, stride_outh,
                     G, D, ROWS, PARTS, dbg_ptr, PROBE)
    if PROBE:
        _stamp(dbg_ptr, 5)  # the end, with or without the merge


def fused_relay_decode(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                       num_splits: int, merge_unroll: int | None = None, in_kernel_merge: bool = False,
                       counters: torch.Tensor | None = None, **tile):
    """One decode step of relay attention, every request behind the one prefix: the fused
    kernel's partials (fused_relay_partials, whose arguments these are), merged.

    Returns o [N, Hq, D] in q's dtype, and the launched kernel.
    in_kernel_merge: the fused kernel's programs merge the partials themselves
    (in_kernel_merge_ok must hold), with no merge kernel; else merge_partials does.
    counters: int32, one per row tile and KV head at least, zero, left zero (a decode graph's
    own; None: allocated here). merge_unroll: merge_partials' partials in flight at once (the
    same bits for any).
    """
    if not in_kernel_merge:
        o_part, lse_part, kernel = fused_relay_partials(q, k_sys, v_sys, k_cache, v_cache, block_tables,
                                                        context_lens, scale, num_splits, **tile)
        return merge_partials(o_part, lse_part, q.dtype, with_lse=False, unroll=merge_unroll)[0], kernel
    n, hq, _ = q.shape
    assert in_kernel_merge_ok(n, hq, k_sys.shape[1], num_splits, q.device), \
        "in-kernel merge: needs 128 % (Hq / Hkv) == 0 and every program resident at once"
    groups = triton.cdiv(n * (hq // k_sys.shape[1]), 128) * k_sys.shape[1]
    if counters is None:
        counters = torch.zeros(groups, dtype=torch.int32, device=q.device)
    assert counters.dtype == torch.int32 and counters.numel() >= groups and counters.is_contiguous(), \
        f"counters: int32, contiguous, at least {groups}"
    out = torch.empty_like(q)
    _, _, kernel = _launch(q, k_sys, v_sys, k_cache, v_cache, block_tables, context_lens, scale, num_splits,
                           out=out, counters=counters, **tile)
    return out, kernel


def in_kernel_merge_ok(num_seqs: int, num_heads: int, num_kv_heads: int, num_splits: int,
                       device: torch.device) -> bool:
    """Whether the fused kernel can merge its own partials: a request's rows in one row tile
    (128 % G == 0, so its own-key partial comes from a program of that tile) and at most one
    program an SM (the cooperative launch needs every program resident at once; the kernel
    takes an SM's registers)."""
    g = num_heads // num_kv_heads
    programs = triton.cdiv(num_seqs * g, 128) * num_kv_heads * num_splits
    return 128 % g == 0 and programs <= num_sms(device)


def merge_block_rows(num_splits: int, head_dim: int) -> int:
    """Rows of one block of the in-kernel merge: the row tile's share of each of its num_splits
    programs (one round of loads each), as far as the num_splits + 1 partials' values stay at
    96 registers a thread or fewer (4 warps, so [rows, D] fp32 is rows * D / 128 a thread)."""
    rows = triton.next_power_of_2(triton.cdiv(128, num_splits))
    while rows > 4 and (num_splits + 1) * rows * head_dim > 96 * 128:
        rows //= 2
    return rows


def fused_relay_partials(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         num_splits: int, **tile):
    """The fused kernel alone: the partials of one decode step, unmerged.

    q [N, Hq, D] contiguous; k_sys/v_sys [S, Hkv, D] contiguous; k_cache/v_cache
    [num_blocks, C, Hkv, D] with C = 64 keys a block; block_tables [N, max_blocks] int32;
    context_lens [N] int32 (own keys; 0 for a padding row of a decode graph, whose own
    partial is then empty and whose table's first block is still read). Returns the fp32
    partials o [num_splits + 1, N, Hq, D] and lse [num_splits + 1, N, Hq] (the own keys' last),
    and the launched kernel. tile: _launch's knobs.
    """
    return _launch(q, k_sys, v_sys, k_cache, v_cache, block_tables, context_lens, scale, num_splits, **tile)


def _launch(q, k_sys, v_sys, k_cache, v_cache, block_tables, context_lens, scale, num_splits,
            block_n: int = 64, stages: int = 3, ctx_tiles: int = 4, launch_regs: int = LAUNCH_REGS,
            sys_regs: int = SYS_REGS, ctx_regs: int = CTX_REGS, ctx_mode: int = 0, q_smem: bool = False,
            out: torch.Tensor | None = None, counters: torch.Tensor | None = None, merge_rows: int | None = None,
            cooperative: bool | None = None, dbg: torch.Tensor | None = None):
    """The fused kernel's launch; out and counters given: the in-kernel merge writes out.

    ctx_mode: 0 the own keys in their warpgroup, 2 none (timing only: the result lacks them).
    ctx_tiles: slots of the own-key ring, a [64, D] K or V tile each (2 or more).
    q_smem: the prefix consumers hold Q in shared memory, not registers (for block_n 128).
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
    merge = out is not None
    assert merge == (counters is not None), "out and counters together"
    rows = merge_block_rows(num_splits, d) if merge_rows is None else merge_rows
    assert rows >= 4 and rows & (rows - 1) == 0 and 128 % rows == 0, f"merge_rows {rows}: a power of two, 4-128"
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
        out if merge else o_part, counters if merge else context_lens, n, s_len, per, num_splits, scale * LOG2E, block_tables.stride(0),
        q.stride(0), q.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0) if merge else 0, out.stride(1) if merge else 0,
        HQ=hq, G=g, D=d, BLOCK_N=block_n, STAGES=stages, C=c, CTX_TILES=ctx_tiles,
        Q_SMEM=q_smem, SYS_REGS_=sys_regs, CTX_REGS_=ctx_regs, CTX_MODE=ctx_mode, MERGE=merge,
        ROWS=rows if merge else 4, PARTS=num_splits + 1 if merge else 1, dbg_ptr=dbg if dbg is not None else context_lens, PROBE=dbg is not None,
        num_warps=4, maxnreg=launch_regs,
        launch_cooperative_grid=merge if cooperative is None else cooperative)
    return o_part, lse_part, kernel

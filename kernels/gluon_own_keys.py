"""The own-key roles of the fused decode kernel (kernels/gluon_fused_relay.py): a warpgroup that
attends the own keys of its program's requests, and the TMA warp that feeds it.

Computed transposed ("swap AB": the keys are the wgmma's M rows, a request's G query rows
its N = 8, padded with other heads' rows), one 64-key chunk a cache block:

    S^T [C, 8] = K_c [C, D] . Q_n^T [D, 8]          O^T [D, 8] += V_c^T [D, C] . P^T [C, 8]

K and V tiles come by TMA into one ring, in the order they are used (K_0, V_0, K_1, ...).
A program (m, h, split) takes the requests whose first query row is among its 128, every
num_splits-th from split on (_ctx_schedule); each request's partial goes to split num_splits
of the fused step's partials. Shapes: gluon_fused_relay.py's docstring; measurements:
docs/kernels.md.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from relaycli.kernels.gluon_system_attention import _acc_layout, _cta_barrier

QN = gl.constexpr(8)  # query rows of an own chunk's wgmma (its N): a request's G rows, padded


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
                  WARPS: gl.constexpr):
    """What both own-key roles walk: (items, chunks, the first item's length, the second's)."""
    n_items = _num_items(req_base, req_end, split, num_splits, (128 + G - 1) // G)
    total = _num_chunks(ctx_ptr, req_base, split, num_splits, n_items, C, (128 + G - 1) // G, WARPS)
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
    2c - ctx_tiles to be done; the Q slot it takes last held chunk (c - slots)'s, whose scores (tile
    2(c - slots)) must be done by then, so slots >= ctx_tiles / 2."""
    return (ctx_tiles + 1) // 2


@gluon.jit
def _ctx_consumer(cr_smem, qc_smem, pc_smem, c_ready, c_empty, ctx_ptr, o_ptr, lse_ptr,
                  req_base, h, split, num_splits, req_end, qk_scale,
                  stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                  G: gl.constexpr, D: gl.constexpr, C: gl.constexpr, CTX_TILES: gl.constexpr):
    """The own-key warpgroup: every chunk of the program's items, in order. The ring holds
    [C, D] tiles in the order they are used, K_0, V_0, K_1, V_1, ...: tile t in slot
    t % CTX_TILES, free again once the wgmma that reads it is done, so a chunk's K slot takes
    the next tile while the chunk's P V still runs (chunk c's Q rows: slot c % _q_slots)."""
    dtype: gl.constexpr = cr_smem.dtype
    st_layout: gl.constexpr = _acc_layout(QN, 4)  # [C, 8] and [D, 8] accumulators, one warpgroup
    col_l: gl.constexpr = gl.SliceLayout(0, st_layout)
    key_l: gl.constexpr = gl.SliceLayout(1, st_layout)
    n_items, total, it_len, nx_len = _ctx_schedule(ctx_ptr, req_base, split, num_splits, req_end, G, C, 4)
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
        s0 = _own_scores(cr_smem, qc_smem, c_ready, c_empty, c, it_c * C, it_len, qk_scale, st_layout, C, CTX_TILES)
        if pair:
            s1 = _own_scores(cr_smem, qc_smem, c_ready, c_empty, c + 1, (it_c + 1) * C, it_len, qk_scale, st_layout,
                             C, CTX_TILES)
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
def _own_scores(cr_smem, qc_smem, c_ready, c_empty, c, first_key, it_len, qk_scale, st_layout: gl.constexpr,
                C: gl.constexpr, CTX_TILES: gl.constexpr):
    """Scaled S^T [C, 8] of chunk c (its K: ring tile 2c), keys from first_key, those at or
    past the item's length it_len -inf; the K slot is free once this returns."""
    tk = 2 * c
    mbarrier.wait(c_ready.index(tk % CTX_TILES), (tk // CTX_TILES) & 1)
    s_tok = warpgroup_mma(cr_smem.index(tk % CTX_TILES), qc_smem.index(c % _q_slots(CTX_TILES)).permute((1, 0)),
                          gl.zeros([C, QN], gl.float32, layout=st_layout), use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(c_empty.index(tk % CTX_TILES), count=1)
    keys = first_key + gl.arange(0, C, layout=gl.SliceLayout(1, st_layout))
    return gl.where(gl.expand_dims(keys < it_len, 1), s * qk_scale, float("-inf"))


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
                  HQ: gl.constexpr, G: gl.constexpr, D: gl.constexpr, C: gl.constexpr, CTX_TILES: gl.constexpr):
    """The own-key TMA warp: chunk c's K and V block and Q rows as soon as its slot is free.
    The next chunk's cache block is read one chunk ahead, so no load latency sits in front
    of a TMA."""
    n_items, total, it_len, nx_len = _ctx_schedule(ctx_ptr, req_base, split, num_splits, req_end, G, C, 1)
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

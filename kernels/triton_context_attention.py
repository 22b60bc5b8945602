"""Paged causal attention in Triton, with the relay fusion in its epilogue.

One program takes a tile of (query, head-in-group) rows of one sequence and one KV head
(decode: the G heads of the single query; prefill: BLOCK_M // G queries x G heads), so
the GQA heads share each K/V tile. Query i of a sequence sits at own position
context_len - q_len + i and sees own keys 0..that position.

The same kernel serves the --no-relay baseline (triton_paged_decode.py): HAS_PREFIX puts
the shared prefix in front of the own keys in one softmax, and the key range can be cut
into splits that write fp32 partials. Each program cuts its own sequence's key range
into num_splits equal chunks (whole key tiles), so the chunks stay balanced whatever the
lengths: a CUDA graph plans its split count for the longest context its bucket allows,
up to 4x the real one, and chunks of a fixed size would leave most split programs empty
and a few long. With HAS_SYS the epilogue folds in the system
step's partials (w = sigmoid(lse_sys - lse_ctx), per split) and writes the final o once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from relaycli.kernels.metadata import AttentionMetadata, PrefixTable
from relaycli.kernels.planner import plan_context
from relaycli.kernels.tiles import Tile
from relaycli.kernels.triton_system_attention import LOG2E, _dense_loop, _finish, _merge_splits, _online_block


@triton.jit
def _paged_loop(acc, m_i, l_i, q, qpos, k_base, v_base, bt_row, lo, hi, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt,
                PAGE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK: tl.constexpr, IEEE: tl.constexpr, BT_AHEAD: tl.constexpr):
    """Own keys lo..hi through the block table; MASK adds the causal and end masks.

    BT_AHEAD: read each tile's block ids one iteration early. A K/V address that comes
    from a block-table load of the same iteration costs Triton's software pipeline a
    stage: at 2-4 stages the K/V tile is then single-buffered and waited for as soon as
    it is issued; with the ids carried from the iteration before, 3 stages double-buffer
    it (an sm_90 compile shows both). Same tiles in the same order: the same results.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if BT_AHEAD:
        blk_next = tl.load(bt_row + (lo + offs_n) // PAGE, mask=lo + offs_n < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        if MASK:
            jmask = j < hi
        if BT_AHEAD:
            blk = blk_next.to(tl.int64)
            blk_next = tl.load(bt_row + (j + BLOCK_N) // PAGE, mask=j + BLOCK_N < hi, other=0)
        elif MASK:
            blk = tl.load(bt_row + j // PAGE, mask=jmask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + j // PAGE).to(tl.int64)
        tok = j % PAGE
        # int64: a large cache is over 2**31 elements
        k_off = blk * stride_kb + tok * stride_kt
        v_off = blk * stride_vb + tok * stride_vt
        if MASK:
            k = tl.load(k_base + k_off[:, None] + offs_d[None, :], mask=jmask[:, None], other=0.0)
            v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=jmask[:, None], other=0.0)
            valid = (j[None, :] <= qpos[:, None]) & jmask[None, :]
        else:
            k = tl.load(k_base + k_off[:, None] + offs_d[None, :])
            v = tl.load(v_base + v_off[:, None] + offs_d[None, :])
            valid = None
        acc, m_i, l_i = _online_block(acc, m_i, l_i, q, k, v, valid, qk_scale, MASK, IEEE)
    return acc, m_i, l_i


@triton.jit
def _paged_program(pid_m, seq, h, split, q_ptr, kc_ptr, vc_ptr, kp_ptr, vp_ptr, o_ptr, lse_ptr, so_ptr, sl_ptr,
                   cu_ptr, ctx_ptr, bt_ptr, grp_ptr, tab_ptr,
                   group_id, prefix_len, num_splits, split_base, sys_splits,
                   qk_scale,
                   stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_ps, stride_ph, stride_bt,
                   stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                   stride_sos, stride_son, stride_soh, stride_sls, stride_sln,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGE: tl.constexpr, HAS_PREFIX: tl.constexpr, FILTER: tl.constexpr, TABLE: tl.constexpr,
                   HAS_SYS: tl.constexpr, SYS_UNROLL: tl.constexpr, WRITE_LSE: tl.constexpr,
                   IEEE: tl.constexpr, BT_AHEAD: tl.constexpr):
    """Row tile pid_m of sequence seq on KV head h, key chunk `split`.

    TABLE (with HAS_PREFIX): the sequence's prefix is its group's in the step's PrefixTable
    (grp_ptr its row_group, tab_ptr its groups), a range of the prefix store at kp_ptr/vp_ptr."""
    if FILTER:  # this launch serves one prefix group; other sequences belong to other launches
        if tl.load(grp_ptr + seq) != group_id:
            return
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    ctx_len = tl.load(ctx_ptr + seq)
    if pid_m * BLOCK_M >= q_len * G:
        return
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    i = r // G
    head = h * G + r % G
    rmask = i < q_len
    row = q_start + i
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    first = ctx_len - q_len
    qpos = first + i
    # own keys every row of the tile sees, and keys at least one row sees
    own_all = first + pid_m * BLOCK_M // G + 1
    own_any = first + tl.minimum(q_len - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // G) + 1
    # 0 without a prefix. A row with no own tokens is padding (a CUDA graph's rows past
    # the batch): this kernel reads nothing for it, not even its prefix (o = 0, lse = -inf).
    if TABLE:
        g = tl.load(grp_ptr + seq)
        prefix_len = tl.load(tab_ptr + g * 4 + 3)
        key0 = tl.load(tab_ptr + g * 4 + 2).to(tl.int64)
        kp_ptr += key0 * stride_ps
        vp_ptr += key0 * stride_ps
    pre = tl.where(ctx_len > 0, prefix_len, 0)
    total = pre + own_any
    per = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, total)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_PREFIX:
        p_hi = tl.minimum(hi, pre)
        p_mid = lo + tl.maximum(p_hi - lo, 0) // BLOCK_N * BLOCK_N
        kp = kp_ptr + h * stride_ph
        vp = vp_ptr + h * stride_ph
        acc, m_i, l_i = _dense_loop(acc, m_i, l_i, q, kp, vp, lo, p_mid, qk_scale, stride_ps, stride_ps, 0,
                                    D, BLOCK_N, False, IEEE, False)
        acc, m_i, l_i = _dense_loop(acc, m_i, l_i, q, kp, vp, p_mid, p_hi, qk_scale, stride_ps, stride_ps, 0,
                                    D, BLOCK_N, True, IEEE, False)
    o_lo = tl.maximum(lo - pre, 0)
    o_hi = hi - pre
    o_mid = o_lo + tl.maximum(tl.minimum(o_hi, own_all) - o_lo, 0) // BLOCK_N * BLOCK_N
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kc = kc_ptr + h * stride_kh
    vc = vc_ptr + h * stride_vh
    acc, m_i, l_i = _paged_loop(acc, m_i, l_i, q, qpos, kc, vc, bt_row, o_lo, o_mid, qk_scale,
                                stride_kb, stride_kt, stride_vb, stride_vt, PAGE, D, BLOCK_N, False, IEEE, BT_AHEAD)
    acc, m_i, l_i = _paged_loop(acc, m_i, l_i, q, qpos, kc, vc, bt_row, o_mid, o_hi, qk_scale,
                                stride_kb, stride_kt, stride_vb, stride_vt, PAGE, D, BLOCK_N, True, IEEE, BT_AHEAD)
    o, lse = _finish(acc, m_i, l_i)
    # relay fusion: fold in every split of the system step, then write once
    if HAS_SYS:
        o, lse = _merge_splits(o, lse, so_ptr, sl_ptr, row * stride_son + head * stride_soh,
                               row * stride_sln + head, stride_sos, stride_sls, sys_splits, rmask, D, SYS_UNROLL)
    slot = split_base + split
    o_off = slot * stride_os + row * stride_on + head * stride_oh
    tl.store(o_ptr + o_off[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr + slot * stride_ls + row * stride_ln + head, lse, mask=rmask)


# Runtime counts that change from step to step are not specialised: Triton would compile
# another variant for a value of 1 or a multiple of 16, inside a running job. The block
# table's row stride is one of them: an eager step's table is as wide as its longest row.
@triton.jit(do_not_specialize=["group_id", "prefix_len", "num_splits", "split_base", "sys_splits", "stride_bt"])
def _paged_kernel(q_ptr, kc_ptr, vc_ptr, kp_ptr, vp_ptr, o_ptr, lse_ptr, so_ptr, sl_ptr,
                  cu_ptr, ctx_ptr, bt_ptr, grp_ptr, tab_ptr,
                  group_id, prefix_len, num_splits, split_base, num_kv_heads, sys_splits,
                  qk_scale,
                  stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_ps, stride_ph, stride_bt,
                  stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                  stride_sos, stride_son, stride_soh, stride_sls, stride_sln,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE: tl.constexpr, HAS_PREFIX: tl.constexpr, FILTER: tl.constexpr, TABLE: tl.constexpr,
                  HEADS_FAST: tl.constexpr,
                  HAS_SYS: tl.constexpr, SYS_UNROLL: tl.constexpr, WRITE_LSE: tl.constexpr,
                  IEEE: tl.constexpr, BT_AHEAD: tl.constexpr):
    if HEADS_FAST:  # neighbouring programs read the neighbouring heads of the same pages
        pid_hs = tl.program_id(0)
        pid_m = tl.program_id(2)
    else:  # neighbouring programs are other sequences on the same head: a shared prefix hits L2
        pid_hs = tl.program_id(2)
        pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    h = pid_hs % num_kv_heads
    split = pid_hs // num_kv_heads
    _paged_program(pid_m, seq, h, split,
                   q_ptr, kc_ptr, vc_ptr, kp_ptr, vp_ptr, o_ptr, lse_ptr, so_ptr, sl_ptr, cu_ptr, ctx_ptr,
                   bt_ptr, grp_ptr, tab_ptr, group_id, prefix_len, num_splits, split_base, sys_splits,
                   qk_scale, stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                   stride_vh, stride_ps, stride_ph, stride_bt, stride_os, stride_on, stride_oh, stride_ls,
                   stride_ln, stride_sos, stride_son, stride_soh, stride_sls, stride_sln, G, D, BLOCK_M,
                   BLOCK_N, PAGE, HAS_PREFIX, FILTER, TABLE, HAS_SYS, SYS_UNROLL, WRITE_LSE, IEEE, BT_AHEAD)


def check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    assert q.dim() == 3 and q.stride(-1) == 1, f"q must be [N, Hq, D] with unit last stride, got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        "k_cache/v_cache must both be [num_blocks, block_size, Hkv, D]"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k_cache/v_cache need a unit last stride"
    assert q.dtype == k_cache.dtype == v_cache.dtype, \
        f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}"
    assert k_cache.shape[1] == meta.block_size, f"cache block size {k_cache.shape[1]} != meta {meta.block_size}"
    assert k_cache.shape[3] == q.shape[2], f"head dim differs: q {q.shape[2]}, cache {k_cache.shape[3]}"
    assert q.shape[1] % k_cache.shape[2] == 0, f"Hq={q.shape[1]} is not a multiple of Hkv={k_cache.shape[2]}"
    d = q.shape[2]
    assert d >= 16 and d & (d - 1) == 0, f"head dim must be a power of two >= 16, got {d}"
    assert q.shape[0] == meta.num_queries, f"q has {q.shape[0]} rows, metadata {meta.num_queries} queries"
    for name, t in (("cu_seqlens_q", meta.cu_seqlens_q), ("context_lens", meta.context_lens),
                    ("block_tables", meta.block_tables)):
        assert t.dtype == torch.int32 and t.device == q.device, f"{name} must be int32 on {q.device}"
        assert t.stride(-1) == 1, f"{name} needs a unit last stride"


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, out: torch.Tensor, lse: torch.Tensor | None = None, split_base: int = 0,
                    num_splits: int = 1,
                    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                    seq_group: torch.Tensor | None = None, group_id: int = 0,
                    prefix_table: PrefixTable | None = None,
                    sys_part: tuple[torch.Tensor, torch.Tensor] | None = None, tile: Tile) -> None:
    """Launch the paged kernel. Results go to out[split_base + s] (out is [splits, N, Hq, D]).

    prefix: (k [S, Hkv, D], v) in front of the own keys; seq_group [B] int32: only sequences
    with seq_group[b] == group_id run; prefix_table: with prefix = the prefix store, each
    sequence's prefix is its group's range of the store (relaycli.kernels.metadata.PrefixTable); sys_part: (o [s, N, Hq, D], lse [s, N, Hq]) merged in
    the epilogue (only with num_splits == 1); lse [splits, N, Hq] fp32 or None. num_splits:
    each sequence's keys are cut into that many chunks of whole key tiles, chunk s of
    cdiv(cdiv(keys, num_splits), BLOCK_N) * BLOCK_N keys starting at s times that (the
    last ones may be short or empty: (0, -inf)). tile: the plan's (kernels/planner.py).
    """
    check_paged(q, k_cache, v_cache, meta)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // hkv
    assert out.dim() == 4 and out.shape[1:] == q.shape and out.stride(-1) == 1, "out must be [splits, N, Hq, D]"
    assert num_splits >= 1, f"num_splits must be at least 1, got {num_splits}"
    assert split_base + num_splits <= out.shape[0], "out has too few split slots"
    assert sys_part is None or num_splits == 1, "the relay epilogue needs the whole context range in one program"
    if lse is not None:
        assert lse.shape == out.shape[:3] and lse.dtype == torch.float32 and lse.stride(-1) == 1
    if prefix is not None:
        kp, vp = prefix
        assert kp.shape == vp.shape and kp.dim() == 3 and kp.shape[1:] == (hkv, d), "prefix must be [S, Hkv, D]"
        assert kp.is_contiguous() and vp.is_contiguous(), "prefix k/v must be contiguous"
        assert kp.dtype == q.dtype and vp.dtype == q.dtype, f"prefix dtype {kp.dtype} != q dtype {q.dtype}"
    if sys_part is not None:
        so, sl = sys_part
        assert so.dim() == 4 and so.shape[1:] == q.shape and so.stride(-1) == 1, "o_sys must be [splits, N, Hq, D]"
        assert sl.shape == so.shape[:3] and sl.dtype == torch.float32 and sl.stride(-1) == 1, \
            "lse_sys must be [splits, N, Hq] fp32"
    if seq_group is not None:
        assert seq_group.shape == (meta.num_seqs,) and seq_group.dtype == torch.int32
    assert prefix_table is None or (prefix is not None and seq_group is None), "a prefix table reads the store"
    if meta.num_seqs == 0 or q.shape[0] == 0:
        return
    m_tiles = triton.cdiv(meta.max_seqlen_q * group, tile.block_m)
    grid = (hkv * num_splits, meta.num_seqs, m_tiles) if tile.heads_fast else (m_tiles, meta.num_seqs, hkv * num_splits)
    kp, vp = prefix if prefix is not None else (k_cache, v_cache)
    so, sl = sys_part if sys_part is not None else (out, out)
    lse_t = lse if lse is not None else out
    _paged_kernel[grid](
        q, k_cache, v_cache, kp, vp, out, lse_t, so, sl,
        meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
        seq_group if seq_group is not None else prefix_table.row_group if prefix_table is not None
        else meta.context_lens, prefix_table.groups if prefix_table is not None else meta.context_lens,
        group_id, kp.shape[0] if prefix is not None else 0, num_splits, split_base,
        hkv, so.shape[0] if sys_part is not None else 0, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        kp.stride(0) if prefix is not None else 0, kp.stride(1) if prefix is not None else 0,
        meta.block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse_t.stride(0) if lse is not None else 0, lse_t.stride(1) if lse is not None else 0,
        so.stride(0), so.stride(1), so.stride(2),
        sl.stride(0) if sys_part is not None else 0, sl.stride(1) if sys_part is not None else 0,
        G=group, D=d, PAGE=meta.block_size, HAS_PREFIX=prefix is not None, FILTER=seq_group is not None,
        TABLE=prefix_table is not None,
        HEADS_FAST=tile.heads_fast, HAS_SYS=sys_part is not None, SYS_UNROLL=4, WRITE_LSE=lse is not None,
        IEEE=q.dtype == torch.float32, BT_AHEAD=tile.bt_ahead, **tile.launch())


def context_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, o_sys: torch.Tensor | None = None, lse_sys: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as relaycli.kernels.reference.context_attention, plus the optional relay fusion.

    q [N, Hq, D], caches [num_blocks, block_size, Hkv, D] -> o [N, Hq, D], lse [N, Hq] fp32.
    With o_sys [N, Hq, D] or [splits, N, Hq, D] and lse_sys [N, Hq] or [splits, N, Hq]
    (-inf where a row has no prefix), o is the merged result and lse that of S u C.
    The launch's tile is kernels/planner.py's (plan_context).
    """
    assert (o_sys is None) == (lse_sys is None), "pass o_sys and lse_sys together"
    check_paged(q, k_cache, v_cache, meta)
    sys_part = None
    if o_sys is not None:
        sys_part = (o_sys[None], lse_sys[None]) if o_sys.dim() == 3 else (o_sys, lse_sys)
    out = torch.empty((1,) + tuple(q.shape), dtype=q.dtype, device=q.device)
    lse = torch.empty((1,) + tuple(q.shape[:2]), dtype=torch.float32, device=q.device)
    tile, = plan_context(q, k_cache, meta).ctx_tiles
    paged_attention(q, k_cache, v_cache, meta, scale, out=out, lse=lse, sys_part=sys_part, tile=tile)
    return out[0], lse[0]

"""Paged decode context attention as a persistent kernel: one loop over (sequence, KV head, key tile).

The same function as triton_context_attention's decode tile without the relay epilogue
(o and lse of each row's own keys, written as one partial slot for the merge kernel); a
different schedule. That kernel runs a program per (sequence, KV head): with relay's
short own contexts (128 keys: four 32-key tiles) each program's software pipeline fills,
drains and ends within a few tiles, so few loads are in flight per register spent, and
beside the system kernel (which holds most of every SM) the context step could not keep
up with it (docs/kernels.md, twentieth session). Here a fixed grid of programs (about one
an SM) walks one flattened loop whose iterations are key tiles of consecutive (sequence,
head) items, so the pipeline's loads run across item boundaries and a few warps keep
num_stages tiles in flight the whole time. An item's state (acc, m, l) restarts at its
first tile and its result is written at its last, as the persistent matmul in Triton's
tutorials keeps its epilogue inside the flattened loop.

Every item has tiles_per_item = cdiv(max_context_len, BLOCK_N) tiles; tiles past a row's
own length are masked (no bytes move for them). A row with no own keys (a CUDA graph's
padding) reads nothing and gets (0, -inf), as in the paged kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels.metadata import AttentionMetadata
from kernels.pdl import launch_options
from kernels.triton_context_attention import check_paged
from kernels.triton_plan import num_sms
from kernels.triton_system_attention import LOG2E, _finish, _online_block

# A 4-warp program capped at 128 registers a thread takes 512 warp-registers: what the
# warp-specialised system kernel at ws_regs=128 leaves free on an SM (docs/kernels.md).
PERSISTENT_TILE = dict(BLOCK_N=32, num_warps=4, num_stages=4, maxnreg=128, programs_per_sm=1)


@triton.jit
def _tile_ids(ctx_ptr, bt_ptr, t, num_seqs, tiles_per_item, num_kv_heads, max_blocks, stride_bt,
              BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """(own length of tile t's sequence, the cache block [BLOCK_N] int64 of each of its keys).
    Block ids past the table (a tile past the longest row) read as block 0, and the
    length masks them; t past the program's last tile reads another's (unused), within
    the last sequence."""
    seq = tl.minimum(t // tiles_per_item // num_kv_heads, num_seqs - 1)
    nblk = (t % tiles_per_item * BLOCK_N + tl.arange(0, BLOCK_N)) // PAGE
    ctx_len = tl.load(ctx_ptr + seq)
    blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + nblk, mask=nblk < max_blocks, other=0)
    return ctx_len, blk.to(tl.int64)


@triton.jit(do_not_specialize=["num_items", "tiles_per_item", "slot"])
def _persistent_decode_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, lse_ptr, ctx_ptr, bt_ptr,
                              num_items, tiles_per_item, num_kv_heads, max_blocks, slot, qk_scale,
                              stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                              stride_vh, stride_bt, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                              G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              PAGE: tl.constexpr, IEEE: tl.constexpr, WAIT_SYS: tl.constexpr):
    """Items item = seq * num_kv_heads + h (the heads of one token are neighbours in the
    cache, so consecutive items read the same pages); program p takes a contiguous run of
    items. q [B, Hq, D] (decode: row = sequence), o/lse: the `slot` partial."""
    pid = tl.program_id(0)
    num_seqs = num_items // num_kv_heads
    per = tl.cdiv(num_items, tl.num_programs(0))
    t_lo = pid * per * tiles_per_item
    t_hi = tl.minimum(pid * per + per, num_items) * tiles_per_item
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    rmask = offs_r < G
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # the block ids and length of each tile are read one iteration ahead and carried: a
    # K/V address that came from a load of the same iteration would cost the software
    # pipeline a stage per load in its chain (length, block id, K/V), and at 2-4 stages
    # leave K/V single-buffered (scripts/compile_report.py)
    ctx_len, blk = _tile_ids(ctx_ptr, bt_ptr, t_lo, num_seqs, tiles_per_item, num_kv_heads, max_blocks, stride_bt,
                             BLOCK_N, PAGE)
    for t in range(t_lo, t_hi):
        item = t // tiles_per_item
        tile = t - item * tiles_per_item
        seq = item // num_kv_heads
        h = item - seq * num_kv_heads
        j = tile * BLOCK_N + offs_n
        jmask = j < ctx_len
        tok = j % PAGE
        # int64: a large cache is over 2**31 elements
        k = tl.load(kc_ptr + h * stride_kh + (blk * stride_kb + tok * stride_kt)[:, None] + offs_d[None, :],
                    mask=jmask[:, None], other=0.0)
        v = tl.load(vc_ptr + h * stride_vh + (blk * stride_vb + tok * stride_vt)[:, None] + offs_d[None, :],
                    mask=jmask[:, None], other=0.0)
        ctx_len, blk = _tile_ids(ctx_ptr, bt_ptr, t + 1, num_seqs, tiles_per_item, num_kv_heads, max_blocks, stride_bt,
                                 BLOCK_N, PAGE)
        head = h * G + offs_r
        q = tl.load(q_ptr + seq * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                    mask=rmask[:, None], other=0.0)
        fresh = tile == 0  # an item's first tile: its state starts over
        acc = tl.where(fresh, 0.0, acc)
        m_i = tl.where(fresh, -1.0e30, m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc, m_i, l_i = _online_block(acc, m_i, l_i, q, k, v, rmask[:, None] & jmask[None, :], qk_scale,
                                      True, IEEE)
        if tile == tiles_per_item - 1:
            o, lse = _finish(acc, m_i, l_i)
            row = seq.to(tl.int64)
            tl.store(o_ptr + slot * stride_os + row * stride_on + head[:, None] * stride_oh + offs_d[None, :],
                     o, mask=rmask[:, None])
            tl.store(lse_ptr + slot * stride_ls + row * stride_ln + head, lse, mask=rmask)
    if WAIT_SYS:
        # launched as a programmatic dependent of the system kernel: the programs never
        # wait to work; the first alone waits, so that this kernel ends after that one
        if pid == 0:
            gdc_wait()


def persistent_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                meta: AttentionMetadata, scale: float, *, out: torch.Tensor, lse: torch.Tensor,
                                slot: int, config: dict | None = None, wait_sys: bool = False) -> None:
    """Own-key attention of a decode step into out[slot] [N, Hq, D] fp32 and lse[slot] [N, Hq] fp32.

    config: PERSISTENT_TILE's keys (num_programs instead of programs_per_sm fixes the grid).
    wait_sys: launch as a programmatic dependent of the kernel before it on the stream
    (paged_attention's wait_sys without sys_part)."""
    check_paged(q, k_cache, v_cache, meta)
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    assert meta.is_decode and meta.max_seqlen_q == 1 and n == meta.num_seqs, \
        "the persistent kernel serves decode steps (one query a sequence)"
    assert group <= 16, f"the persistent kernel's 16-row tile holds at most 16 heads a KV head, got {group}"
    assert out.dtype == torch.float32 and out.dim() == 4 and out.shape[1:] == q.shape and out.stride(-1) == 1, \
        "out must be [slots, N, Hq, D] fp32"
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:3] and lse.stride(-1) == 1, \
        "lse must be [slots, N, Hq] fp32"
    assert 0 <= slot < out.shape[0], f"slot {slot} is outside the {out.shape[0]} partial slots"
    assert not wait_sys or q.is_cuda, "wait_sys needs CUDA"
    cfg = dict(PERSISTENT_TILE, **(config or {}))
    cfg.pop("persistent", None)
    per_sm = cfg.pop("programs_per_sm")
    num_items = n * hkv
    if num_items == 0:
        return
    num_programs = cfg.pop("num_programs", None) or per_sm * num_sms(q.device)
    if not q.is_cuda:
        cfg.pop("maxnreg", None)
    tiles_per_item = max(1, triton.cdiv(meta.max_context_len, cfg["BLOCK_N"]))
    _persistent_decode_kernel[(min(num_programs, num_items),)](
        q, k_cache, v_cache, out, lse, meta.context_lens, meta.block_tables,
        num_items, tiles_per_item, hkv, meta.block_tables.shape[1], slot, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        G=group, D=d, BLOCK_M=16, PAGE=meta.block_size, IEEE=q.dtype == torch.float32, WAIT_SYS=wait_sys,
        **cfg, **launch_options(wait_sys))

"""System attention in Triton: every query of a batch against one shared prefix.

For KV head h the G query heads of all n queries form one [n*G, D] matrix (row r is
query r // G, head h*G + r % G), so one tile of K_S/V_S read from HBM serves BLOCK_M
rows through tl.dot. When n*G is small the prefix is cut into `num_splits` chunks
(flash-decoding): each program writes a partial (o, lse) in fp32, and the partials are
merged exactly, either by the merge kernel (kernels/triton_merge.py) or in the epilogue of
the context kernel.

The online-softmax and merge helpers below are shared with the paged and merge kernels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from relaycli.kernels.planner import AttentionPlan, plan_system
from relaycli.kernels.tiles import DECODE_TILE, Tile
from relaycli.kernels.triton_plan import tma_ok

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _online_block(acc, m_i, l_i, q, k, v, valid, qk_scale, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One key tile of the online softmax; m_i is in the scaled log2 domain.

    q [BM, D], k/v [BN, D], valid [BM, BN] (read only when MASK). The scale is applied
    to the row max and inside exp2's argument (one FMA a score, not a multiply and a
    subtract). m_i starts at a finite -1e30 so a fully masked tile gives p = 0, not NaN.
    """
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _dense_loop(acc, m_i, l_i, q, k_base, v_base, lo, hi, qk_scale, stride_ks, stride_vs, col,
                D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr,
                TMA: tl.constexpr):
    """Keys lo..hi of a contiguous [S, ., D] tensor.

    Pointers: k_base/v_base already at the head. TMA: they are [S, Hkv*D] tensor
    descriptors and col = h*D; rows past S arrive as zeros and the tail mask drops them.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        keys = start + offs_n
        if TMA:
            k = k_base.load([start, col])
            v = v_base.load([start, col])
            valid = keys[None, :] < hi
        elif MASK:
            kmask = keys < hi
            k = tl.load(k_base + keys[:, None] * stride_ks + offs_d[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(v_base + keys[:, None] * stride_vs + offs_d[None, :], mask=kmask[:, None], other=0.0)
            valid = kmask[None, :]
        else:
            k = tl.load(k_base + keys[:, None] * stride_ks + offs_d[None, :])
            v = tl.load(v_base + keys[:, None] * stride_vs + offs_d[None, :])
            valid = None
        acc, m_i, l_i = _online_block(acc, m_i, l_i, q, k, v, valid, qk_scale, MASK, IEEE)
    return acc, m_i, l_i


@triton.jit
def _finish(acc, m_i, l_i):
    """Normalised o [BM, D] fp32 and natural-log lse [BM]; no keys -> (0, -inf)."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse


@triton.jit
def _merge_pair(o_a, lse_a, o_b, lse_b):
    """Exact merge of two disjoint-key results; equals w*o_a + (1-w)*o_b, w = sigmoid(lse_a - lse_b).

    A side with lse = -inf contributes nothing, even if its o holds garbage.
    """
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    den = w_a + w_b
    num = tl.where(w_a[:, None] > 0, o_a * w_a[:, None], 0.0) + tl.where(w_b[:, None] > 0, o_b * w_b[:, None], 0.0)
    safe = tl.where(den == 0.0, 1.0, den)
    return num / safe[:, None], tl.where(den == 0.0, float("-inf"), m + tl.log(safe))


@triton.jit
def _merge_splits(o, lse, po_ptr, pl_ptr, o_off, lse_off, stride_o_split, stride_l_split, num_splits, mask,
                  D: tl.constexpr, UNROLL: tl.constexpr):
    """Fold partials 0..num_splits-1 into (o [R, D] fp32, lse [R]), in split order.

    Row r's partial s is at po_ptr + s * stride_o_split + o_off[r] (D values) and
    pl_ptr + s * stride_l_split + lse_off[r]. The count is a runtime value (a constexpr
    would compile a variant per count, inside a running job), and Triton does not
    pipeline this loop: UNROLL splits are loaded together so their loads are in flight
    at once, and a split past the count merges as lse = -inf, which leaves (o, lse)
    unchanged to the bit (_merge_pair is symmetric to the bit).
    """
    offs_d = tl.arange(0, D)
    for s0 in range(0, num_splits, UNROLL):
        for u in tl.static_range(UNROLL):
            s = s0 + u
            ok = mask & ((lse_off * 0 + s) < num_splits)  # a tensor compare: s may be a plain int
            lse_s = tl.load(pl_ptr + s * stride_l_split + lse_off, mask=ok, other=float("-inf"))
            o_s = tl.load(po_ptr + s * stride_o_split + o_off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
            o, lse = _merge_pair(o, lse, o_s.to(tl.float32), lse_s)
    return o, lse


@triton.jit
def _system_program(pid_m, h, split, q_ptr, k_ptr, v_ptr, rows_ptr, o_ptr, lse_ptr,
                    n_queries, seq_len, keys_per_split, qk_scale,
                    stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                    stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_ROWS: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    """Row tile pid_m of KV head h against chunk `split` of the prefix (the body of the kernel below)."""
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = r // G
    head = h * G + r % G
    rmask = n < n_queries
    if HAS_ROWS:  # a prefix group: its queries are scattered rows of the packed batch
        row = tl.load(rows_ptr + n, mask=rmask, other=0)
    else:
        row = n
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, seq_len)
    mid = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if TMA:
        k_base = k_ptr
        v_base = v_ptr
    else:
        k_base = k_ptr + h * stride_kh
        v_base = v_ptr + h * stride_vh
    # Full tiles need no mask; only the chunk's ragged tail does.
    acc, m_i, l_i = _dense_loop(acc, m_i, l_i, q, k_base, v_base, lo, mid, qk_scale, stride_ks,
                                stride_vs, h * D, D, BLOCK_N, False, IEEE, TMA)
    acc, m_i, l_i = _dense_loop(acc, m_i, l_i, q, k_base, v_base, mid, hi, qk_scale, stride_ks,
                                stride_vs, h * D, D, BLOCK_N, True, IEEE, TMA)
    o, lse = _finish(acc, m_i, l_i)
    o_off = split * stride_os + row * stride_on + head * stride_oh
    tl.store(o_ptr + o_off[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(lse_ptr + split * stride_ls + row * stride_ln + head, lse, mask=rmask)


@triton.jit(do_not_specialize=["n_queries", "keys_per_split"])  # per-step counts: no variant per value
def _system_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, o_ptr, lse_ptr,
                   n_queries, seq_len, keys_per_split, qk_scale,
                   stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                   stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_ROWS: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    _system_program(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, k_ptr, v_ptr, rows_ptr,
                    o_ptr, lse_ptr, n_queries, seq_len, keys_per_split, qk_scale,
                    stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                    stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                    G, D, BLOCK_M, BLOCK_N, HAS_ROWS, IEEE, TMA)


def check_prefix(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor) -> None:
    assert q.dim() == 3 and q.stride(-1) == 1, f"q must be [N, Hq, D] with unit last stride, got {tuple(q.shape)}"
    assert k_sys.dim() == 3 and k_sys.shape == v_sys.shape, "k_sys/v_sys must both be [S, Hkv, D]"
    assert k_sys.stride(-1) == 1 and v_sys.stride(-1) == 1, "k_sys/v_sys need a unit last stride"
    assert k_sys.dtype == v_sys.dtype == q.dtype, f"dtypes differ: q {q.dtype}, k_sys {k_sys.dtype}, v_sys {v_sys.dtype}"
    assert k_sys.shape[2] == q.shape[2], f"head dim differs: q {q.shape[2]}, k_sys {k_sys.shape[2]}"
    assert q.shape[1] % k_sys.shape[1] == 0, f"Hq={q.shape[1]} is not a multiple of Hkv={k_sys.shape[1]}"
    d = q.shape[2]
    assert d >= 16 and d & (d - 1) == 0, f"head dim must be a power of two >= 16, got {d}"
    assert q.device == k_sys.device == v_sys.device, "q and the prefix must be on one device"


GLUON_TRITON_VERSIONS = ("3.6.",)  # Gluon is experimental: taken only on the releases its API is tested on


def gluon_usable(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor) -> bool:
    """Whether kernels/gluon_system_attention.py can take this problem (Hopper, 16-bit, D 64/128)."""
    if not (q.is_cuda and triton.__version__.startswith(GLUON_TRITON_VERSIONS)):
        return False
    from relaycli.kernels.gluon_system_attention import gluon_ok
    return gluon_ok(q, k_sys) and gluon_ok(q, v_sys)


def system_attention_into(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, scale: float,
                          o_part: torch.Tensor, lse_part: torch.Tensor, rows: torch.Tensor | None,
                          tile: Tile) -> None:
    """Write per-split results of q[rows] against the prefix into o_part[s, rows], lse_part[s, rows].

    q [N, Hq, D]; k_sys/v_sys [S, Hkv, D]; rows [n] int64 or None (all N rows);
    o_part [splits, N, Hq, D] (any float dtype), lse_part [splits, N, Hq] fp32; the prefix
    is cut into o_part.shape[0] splits, and a chunk with no keys gets (0, -inf).
    tile: the plan's (kernels/planner.py), its tma and gluon decided. Where these tensors
    cannot take what the tile asks (the Gluon kernel: sm_90, 16-bit, D 64/128, a Triton
    release it is tested on; TMA: aligned, at least a tile of keys), the tile runs in its
    portable form: the Triton kernel (at DECODE_TILE's sizes for the warp-specialised
    tile, which is Gluon's alone), pointers for TMA.
    """
    check_prefix(q, k_sys, v_sys)
    n_q = q.shape[0] if rows is None else rows.shape[0]
    hkv = k_sys.shape[1]
    group = q.shape[1] // hkv
    assert o_part.shape[1:] == q.shape and lse_part.shape == o_part.shape[:3], "partial buffers mis-shaped"
    assert o_part.stride(-1) == 1 and lse_part.stride(-1) == 1 and lse_part.dtype == torch.float32
    assert tile.tma is not None and tile.gluon is not None, "the planner decides tma and gluon for a step"
    splits = o_part.shape[0]
    if rows is not None:
        assert rows.dim() == 1 and rows.dtype == torch.int64, "rows must be [n] int64"
    if n_q == 0:
        return
    if tile.gluon and gluon_usable(q, k_sys, v_sys):
        from relaycli.kernels.gluon_system_attention import gluon_system_attention_into
        gluon_system_attention_into(q, k_sys, v_sys, scale, o_part, lse_part, rows, splits,
                                    tile.block_m, tile.block_n, tile.num_stages, ws=tile.ws)
        return
    if tile.ws:
        tile = tile.replace(block_m=DECODE_TILE.block_m, block_n=DECODE_TILE.block_n,
                            num_warps=DECODE_TILE.num_warps, num_stages=DECODE_TILE.num_stages)
    seq_len = k_sys.shape[0]
    tma = tile.tma and seq_len >= tile.block_n and tma_ok(k_sys) and tma_ok(v_sys)
    per = math.ceil(math.ceil(max(seq_len, 1) / splits) / tile.block_n) * tile.block_n
    grid = (triton.cdiv(n_q * group, tile.block_m), hkv, splits)
    k_arg, v_arg = k_sys, v_sys
    if tma:  # the copy engine fetches [block_n, D] tiles of the [S, Hkv*D] view
        k_arg, v_arg = (TensorDescriptor.from_tensor(t.view(seq_len, -1), [tile.block_n, q.shape[2]])
                        for t in (k_sys, v_sys))
    _system_kernel[grid](
        q, k_arg, v_arg, rows if rows is not None else q, o_part, lse_part,
        n_q, seq_len, per, scale * LOG2E,
        q.stride(0), q.stride(1), k_sys.stride(0), k_sys.stride(1), v_sys.stride(0), v_sys.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        G=group, D=q.shape[2], HAS_ROWS=rows is not None, IEEE=q.dtype == torch.float32, TMA=tma, **tile.launch())


def system_attention(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as relaycli.kernels.reference.system_attention.

    q [N, Hq, D], k_sys/v_sys [S, Hkv, D] -> o [N, Hq, D] (q's dtype), lse [N, Hq] fp32.
    """
    check_prefix(q, k_sys, v_sys)
    return run_system(plan_system(q, k_sys), q, k_sys, v_sys, scale)


def run_system(plan: AttentionPlan, q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """system_attention as a SYSTEM plan says: its splits and tile, then its merge."""
    check_prefix(q, k_sys, v_sys)
    n, hq, d = q.shape
    if plan.sys_splits == 1:  # write the final result straight away, no partial round trip
        o = torch.empty_like(q)
        lse = torch.empty(n, hq, dtype=torch.float32, device=q.device)
        system_attention_into(q, k_sys, v_sys, scale, o[None], lse[None], None, plan.sys_tile)
        return o, lse
    o_part = torch.empty(plan.sys_splits, n, hq, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(plan.sys_splits, n, hq, dtype=torch.float32, device=q.device)
    system_attention_into(q, k_sys, v_sys, scale, o_part, lse_part, None, plan.sys_tile)
    from relaycli.kernels.triton_merge import merge_partials
    return merge_partials(o_part, lse_part, q.dtype, plan.merge)

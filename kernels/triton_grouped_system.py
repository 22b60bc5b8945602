"""System attention for a step whose rows use several prefixes, in one launch.

The rows of such a step are ordered by prefix group, and the step's PrefixTable says,
as device data, which rows each group holds and where its prefix lies in the prefix
store (every loaded prefix's K/V, one after another, relaycli.kernels.metadata.LayerPrefixes).
A program takes a tile of (query, head-in-group) rows of one KV head, as the one-prefix
system kernel does, and walks the groups its rows belong to (rows are sorted, so those
are a short run, usually one): for each, it streams split `split` of that group's prefix
through the online softmax with the rows of other groups masked out, so each row ends
with its own prefix's (o, lse) and a row without a prefix with (0, -inf). A CUDA graph
captured once serves any mix of prefixes, and each group's prefix is read once for all
of its rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from relaycli.kernels.metadata import PrefixTable
from relaycli.kernels.tiles import Tile
from relaycli.kernels.triton_system_attention import LOG2E, _finish, _online_block, check_prefix


@triton.jit(do_not_specialize=["n_rows", "num_groups"])
def _grouped_system_kernel(q_ptr, k_ptr, v_ptr, row_group_ptr, groups_ptr, o_ptr, lse_ptr,
                           n_rows, num_groups, qk_scale,
                           stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                           stride_os, stride_on, stride_oh, stride_ls, stride_ln,
                           G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           IEEE: tl.constexpr):
    """grid (cdiv(n_rows * G, BLOCK_M), Hkv, splits). groups_ptr: [num_groups + 1, 4] int32
    (first row, end row, first key in the store, keys); row_group_ptr: [n_rows] int32, the
    group of each row, num_groups for a row without a prefix (those come last)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = r // G
    head = h * G + r % G
    rmask = n < n_rows
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + n[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    first = pid_m * BLOCK_M // G
    last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, n_rows - 1)
    g_lo = tl.load(row_group_ptr + first)
    g_hi = tl.minimum(tl.load(row_group_ptr + last), num_groups - 1)
    for g in range(g_lo, g_hi + 1):
        row_lo = tl.load(groups_ptr + g * 4)
        row_hi = tl.load(groups_ptr + g * 4 + 1)
        key0 = tl.load(groups_ptr + g * 4 + 2).to(tl.int64)
        num_keys = tl.load(groups_ptr + g * 4 + 3)
        mine = (n >= row_lo) & (n < row_hi)
        per = tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per
        hi = tl.minimum(lo + per, num_keys)
        k_base = k_ptr + key0 * stride_ks + h * stride_kh
        v_base = v_ptr + key0 * stride_vs + h * stride_vh
        for start in range(lo, hi, BLOCK_N):
            keys = start + offs_n
            kmask = keys < hi
            keys = keys.to(tl.int64)
            k = tl.load(k_base + keys[:, None] * stride_ks + offs_d[None, :], mask=kmask[:, None], other=0.0)
            v = tl.load(v_base + keys[:, None] * stride_vs + offs_d[None, :], mask=kmask[:, None], other=0.0)
            valid = mine[:, None] & kmask[None, :]
            acc, m_i, l_i = _online_block(acc, m_i, l_i, q, k, v, valid, qk_scale, True, IEEE)
    o, lse = _finish(acc, m_i, l_i)
    o_off = split * stride_os + n * stride_on + head * stride_oh
    tl.store(o_ptr + o_off[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(lse_ptr + split * stride_ls + n * stride_ln + head, lse, mask=rmask)


def grouped_system_attention_into(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                                  table: PrefixTable, scale: float, o_part: torch.Tensor,
                                  lse_part: torch.Tensor, tile: Tile) -> None:
    """Write each row's split-s result against its own group's prefix into o_part[s, row],
    lse_part[s, row] for every split s (o_part.shape[0] of them); (0, -inf) for a row
    without a prefix and for an empty split.

    q [N, Hq, D] (one query a row: a decode step); k_store/v_store [S_total, Hkv, D];
    table.row_group [N] int32, table.groups [num_groups + 1, 4] int32 on q's device;
    o_part [splits, N, Hq, D] (any float dtype), lse_part [splits, N, Hq] fp32; tile: the
    plan's (kernels/planner.py, triton_plan.grouped_config)."""
    check_prefix(q, k_store, v_store)
    n, hq, d = q.shape
    hkv = k_store.shape[1]
    assert table.row_group.shape == (n,) and table.row_group.dtype == torch.int32, "row_group must be [N] int32"
    assert table.groups.shape == (table.num_groups + 1, 4) and table.groups.dtype == torch.int32, \
        "groups must be [num_groups + 1, 4] int32"
    assert table.row_group.device == q.device == table.groups.device, "the table must be on q's device"
    assert o_part.shape[1:] == q.shape and lse_part.shape == o_part.shape[:3], "partial buffers mis-shaped"
    assert o_part.stride(-1) == 1 and lse_part.stride(-1) == 1 and lse_part.dtype == torch.float32
    if n == 0:
        return
    grid = (triton.cdiv(n * (hq // hkv), tile.block_m), hkv, o_part.shape[0])
    _grouped_system_kernel[grid](
        q, k_store, v_store, table.row_group, table.groups, o_part, lse_part,
        n, table.num_groups, scale * LOG2E,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        G=hq // hkv, D=d, IEEE=q.dtype == torch.float32, **tile.launch())

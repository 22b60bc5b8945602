"""The merge kernel: split partials (o, lse) of disjoint key ranges folded into one result.

Partials [splits, N, H, D] / [splits, N, H] in fp32 (the system kernel's splits, the context
kernel's, the fused decode kernel's) merge exactly by their log-sum-exps (_merge_splits in
kernels/triton_system_attention.py, which the context kernel's epilogue uses too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from relaycli.kernels.pdl import launch_options, pdl_supported
from relaycli.kernels.tiles import MergeTile
from relaycli.kernels.triton_system_attention import _merge_splits


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(po_ptr, pl_ptr, o_ptr, lse_ptr, num_splits, num_heads,
                  stride_ps, stride_pn, stride_ph, stride_qs, stride_qn,
                  stride_on, stride_oh, stride_ln,
                  D: tl.constexpr, BLOCK_H: tl.constexpr, WRITE_LSE: tl.constexpr, UNROLL: tl.constexpr,
                  WAIT: tl.constexpr):
    """Merge partials [splits, N, Hq, D] / [splits, N, Hq] of one row and BLOCK_H heads.

    A decode step has few rows, so few programs, each walking the splits in turn: UNROLL
    of them are loaded at once (_merge_splits). WAIT: launched as a programmatic dependent
    of the kernel that wrote the partials, so wait for it before any load.
    """
    if WAIT:
        gdc_wait()
    n = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_d = tl.arange(0, D)
    o = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    lse = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    o, lse = _merge_splits(o, lse, po_ptr, pl_ptr, n * stride_pn + heads * stride_ph, n * stride_qn + heads,
                           stride_ps, stride_qs, num_splits, hmask, D, UNROLL)
    tl.store(o_ptr + n * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr + n * stride_ln + heads, lse, mask=hmask)


def merge_partials(o_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype, tile: MergeTile,
                   with_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge [splits, N, H, D] / [splits, N, H] partials -> o [N, H, D] out_dtype, lse [N, H] fp32.

    tile: the plan's merge launch (planner.merge_tile): block_h heads a program (a power of
    two), unroll splits whose loads are in flight together (the same bits for any value),
    pdl: launched as a programmatic dependent of the kernel before it on the stream (sm_90,
    relaycli.kernels.pdl), its programs placed as that kernel's last ones leave and waiting
    for it in griddepcontrol.wait before any load (the same bits)."""
    assert not tile.pdl or pdl_supported(o_part.device), "pdl needs an sm_90 or newer CUDA device"
    assert tile.unroll >= 1, f"unroll must be at least 1, got {tile.unroll}"
    assert tile.block_h >= 1 and tile.block_h & (tile.block_h - 1) == 0, f"block_h {tile.block_h}: a power of two"
    splits, n, heads, d = o_part.shape
    o = torch.empty(n, heads, d, dtype=out_dtype, device=o_part.device)
    lse = torch.empty(n, heads, dtype=torch.float32, device=o_part.device) if with_lse else None
    if n == 0:
        return o, lse
    grid = (n, triton.cdiv(heads, tile.block_h))
    _merge_kernel[grid](
        o_part, lse_part, o, lse if with_lse else o, splits, heads,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        o.stride(0), o.stride(1), lse.stride(0) if with_lse else 0,
        D=d, BLOCK_H=tile.block_h, WRITE_LSE=with_lse, UNROLL=tile.unroll, WAIT=tile.pdl, num_warps=4,
        **launch_options(tile.pdl))
    return o, lse

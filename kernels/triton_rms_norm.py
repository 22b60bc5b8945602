"""Residual add + RMSNorm in one Triton kernel (one launch instead of about eight).

Rounding happens at the points where transformers' Llama rounds: the residual sum is
rounded to the run dtype, the norm is taken in fp32, the normalised row is rounded to
the run dtype, then multiplied by the weight and rounded again. Only the order of the
sum of squares differs from PyTorch's, so results agree to about one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from relaycli.kernels.pdl import launch_options


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,
                         stride_x, stride_r, stride_o, stride_ro,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched as a programmatic dependent: wait for the kernel before, then touch memory
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dt = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * (1.0 / tl.sqrt_rn(var + eps))).to(dt)  # x * rsqrt(var + eps), as the eager op
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dt), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [N, H] (residual None on the first layer), weight [H] ->
    (rmsnorm(x + residual) * weight, x + residual), both [N, H] in x's dtype.

    pdl: launch as a programmatic dependent of the kernel before (relaycli.kernels.pdl)."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [N, H] with unit last stride, got {tuple(x.shape)}"
    n, hidden = x.shape
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and weight.is_contiguous(), \
        f"weight must be [{hidden}] contiguous {x.dtype}, got {tuple(weight.shape)} {weight.dtype}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1, \
            "residual must match x"
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if n:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(n,)](
            x, residual if residual is not None else x, weight, out, res_out, hidden, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)), PDL=pdl,
            **launch_options(pdl))
    return out, res_out

"""silu(gate) * up in one Triton launch, rounded as transformers rounds (silu to the run
dtype first, then the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from relaycli.kernels.pdl import launch_options


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, width, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched as a programmatic dependent: wait for the kernel before, then touch memory
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + width + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """gate_up [N, 2I] (gate then up, one matmul's output) -> silu(gate) * up [N, I].

    pdl: launch as a programmatic dependent of the kernel before (relaycli.kernels.pdl)."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0, \
        f"gate_up must be [N, 2I] with unit last stride, got {tuple(gate_up.shape)}"
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, width, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(width, block))](gate_up, out, width, gate_up.stride(0), out.stride(0),
                                                         BLOCK=block, num_warps=4, PDL=pdl, **launch_options(pdl))
    return out

"""Rotary embedding of q and k in one Triton launch (rotate-half layout, as transformers).

transformers computes x * cos + rotate_half(x) * sin with each product rounded to the run
dtype before the sum; the kernel rounds at the same points and is compiled without
floating-point contraction (enable_fp_fusion=False): with contraction the compiler fuses
products into the sums, and many fp16/bf16 results then differ from the eager model by one
unit in the last place (tests/test_triton_layer_ops.py allows one unit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from relaycli.kernels.pdl import launch_options
from relaycli.kernels.reference import check_kv_write


@triton.jit
def _rope_heads(x_ptr, o_ptr, row, out_row, stride_x, stride_xh, stride_o, stride_oh, num_heads, c1, c2, s1, s2,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hmask = heads[:, None] < num_heads
    base = x_ptr + row * stride_x + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=hmask, other=0.0)
    x2 = tl.load(base + HALF, mask=hmask, other=0.0)
    dt = x1.dtype
    # out1 = x1*cos1 - x2*sin1, out2 = x2*cos2 + x1*sin2; each product rounded first
    a = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b = (-x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    c = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    e = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    obase = o_ptr + out_row * stride_o + heads[:, None] * stride_oh + d[None, :]
    tl.store(obase, (a + b).to(dt).to(o_ptr.dtype.element_ty), mask=hmask)
    tl.store(obase + HALF, (c + e).to(dt).to(o_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, v_ptr, vo_ptr, slot_ptr, num_q_heads, num_k_heads,
                 stride_q, stride_qh, stride_k, stride_kh, stride_c, stride_qo, stride_qoh, stride_ko, stride_koh,
                 stride_v, stride_vh, stride_vo, stride_voh,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, TO_CACHE: tl.constexpr,
                 PDL: tl.constexpr):
    """One token: rotate q into qo; rotate k into ko (TO_CACHE: the paged cache's slot of the
    token, and v copied into its slot too)."""
    if PDL:  # launched as a programmatic dependent: wait for the kernel before, then touch memory
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    # cos/sin are already in the run dtype (as transformers casts them); products in fp32
    c1 = tl.load(cos_ptr + row * stride_c + d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + row * stride_c + HALF + d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + row * stride_c + d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + row * stride_c + HALF + d).to(tl.float32)[None, :]
    _rope_heads(q_ptr, qo_ptr, row, row, stride_q, stride_qh, stride_qo, stride_qoh, num_q_heads, c1, c2, s1, s2,
                HALF, BLOCK_HQ)
    if TO_CACHE:
        out_row = tl.load(slot_ptr + row)
    else:
        out_row = row
    _rope_heads(k_ptr, ko_ptr, row, out_row, stride_k, stride_kh, stride_ko, stride_koh, num_k_heads,
                c1, c2, s1, s2, HALF, BLOCK_HK)
    if TO_CACHE:
        heads = tl.arange(0, BLOCK_HK)[:, None]
        dd = tl.arange(0, 2 * HALF)[None, :]
        hmask = heads < num_k_heads
        v = tl.load(v_ptr + row * stride_v + heads * stride_vh + dd, mask=hmask)
        tl.store(vo_ptr + out_row * stride_vo + heads * stride_voh + dd, v.to(vo_ptr.dtype.element_ty), mask=hmask)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], \
        f"q must be [N, Hq, D] and k [N, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}"
    n, _, d = q.shape
    cos, sin = cos.reshape(n, d), sin.reshape(n, d)
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0, f"head dim must be twice a power of two, got {d}"
    assert q.dtype == k.dtype == cos.dtype == sin.dtype, "q, k, cos and sin must share a dtype"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride(), \
        "q, k, cos and sin need a unit last stride"
    return cos, sin


def _launch(q, k, cos, sin, q_out, k_out, v, v_out, slots, k_row_stride, v_row_stride, pdl) -> None:
    n, hq, d = q.shape
    hk = k.shape[1]
    if n == 0:
        return
    _rope_kernel[(n,)](
        q, k, cos, sin, q_out, k_out, v, v_out, slots, hq, hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_row_stride, d, v.stride(0), v.stride(1), v_row_stride, d,
        HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
        TO_CACHE=slots is not None, num_warps=8 if triton.next_power_of_2(hq) * d >= 8192 else 4,
        enable_fp_fusion=False, PDL=pdl, **launch_options(pdl))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k [N, Hkv, D] (views with unit last stride are fine), cos/sin [N, D] or
    [N, 1, D] in q's dtype -> rotated q, k, new contiguous tensors. pdl: relaycli.kernels.pdl."""
    cos, sin = _check(q, k, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, cos, sin, q_out, k_out, k, k_out, None, k_out.stride(0), k_out.stride(0), pdl)
    return q_out, k_out


def rope_into_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    pdl: bool = False) -> torch.Tensor:
    """rope(q, k) with the rotated k, and v, stored at their flat slots of the paged cache.

    One launch instead of three (rope, then write_kv's two copies) and no k tensor in
    between; k/v land exactly as rope + write_kv would put them. q, k, v [N, H, D] with unit
    last stride; caches [num_blocks, block_size, Hkv, D] contiguous; slot_mapping [N] int64.
    Returns the rotated q [N, Hq, D]. pdl: relaycli.kernels.pdl.
    """
    cos, sin = _check(q, k, cos, sin)
    check_kv_write(k_cache, v_cache, k, v, slot_mapping)
    assert v.stride(-1) == 1 and q.device == k.device, "v needs a unit last stride, and q, k one device"
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    row = k.shape[1] * k.shape[2]  # a flat slot of the cache
    _launch(q, k, cos, sin, q_out, k_cache, v, v_cache, slot_mapping, row, row, pdl)
    return q_out

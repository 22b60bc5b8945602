"""The CPU fast path: kernels/reference.py's algorithms on PyTorch's fused CPU flash
attention, which returns the LSE too (aten::_scaled_dot_product_flash_attention_for_cpu).

The reference materialises every score matrix in fp32 and walks it several times; the
fused kernel tiles it through cache, several times faster for prefill and for the
system step. Same contract and shapes as reference.attention_lse; tested against it.
"""

from __future__ import annotations

import functools

import torch

from relaycli.kernels import reference


def is_available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def fused_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], mask [B, Tq, Tk] bool -> o [B, Tq, Hq, D], lse [B, Tq, Hq] fp32."""
    assert q.device.type == "cpu", "the fused CPU kernel takes CPU tensors"
    bsz, tq, hq, dim = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    # GQA without copying K/V: the G query heads of a KV head become G*Tq rows of it.
    qg = q.view(bsz, tq, hkv, group, dim).permute(0, 2, 3, 1, 4).reshape(bsz, hkv, group * tq, dim)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, Tk, D]
    bias = None
    if mask is not None:
        rows = mask[:, None].expand(bsz, group, tq, mask.shape[-1]).reshape(bsz, 1, group * tq, -1)
        bias = torch.zeros(rows.shape, dtype=q.dtype).masked_fill_(~rows, float("-inf"))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, kt, vt, 0.0, False,
                                                                         attn_mask=bias, scale=scale)[:2]
    if mask is not None:
        # The kernel reports lse = 0 for a row with no keys; the contract says -inf.
        empty = ~rows.any(-1)[:, 0]
        lse = lse.masked_fill(empty[:, None, :].expand_as(lse), float("-inf"))
    o = o.view(bsz, hkv, group, tq, dim).permute(0, 3, 1, 2, 4).reshape(bsz, tq, hq, dim)
    lse = lse.float().view(bsz, hkv, group, tq).permute(0, 3, 1, 2).reshape(bsz, tq, hq)
    return o, lse


relay_attention = functools.partial(reference.relay_attention, attend=fused_attention_lse)
prefix_paged_attention = functools.partial(reference.prefix_paged_attention, attend=fused_attention_lse)
write_kv = reference.write_kv

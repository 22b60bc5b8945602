"""Pure-PyTorch attention: the ground truth for every kernel, and the CPU path.

Shapes: N packed queries, B sequences, Hq query heads, Hkv KV heads, G = Hq // Hkv,
D head dim, S system-prefix tokens. Softmax and LSE are computed in fp32; the LSE is
the natural-log log-sum-exp of the scaled scores. A query with no keys has o = 0 and
lse = -inf, so merging it with anything returns the other side unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch

from relaycli.kernels.metadata import AttentionMetadata, LayerPrefixes, PrefixGroup

NEG_INF = float("-inf")
# attend(q [B, Tq, Hq, D], k [B, Tk, Hkv, D], v, scale, mask [B, Tq, Tk] | None) -> (o, lse):
# the one primitive below; kernels/cpu_flash.py passes a fused one with the same contract.
AttendLSE = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched attention that also returns the LSE.

    q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], mask [B, Tq, Tk] bool (True = attend) or None.
    Returns o [B, Tq, Hq, D] in q's dtype and lse [B, Tq, Hq] fp32.
    """
    bsz, tq, hq, dim = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    # [B, Hkv, G*Tq, D]: the G query heads of a KV head share one matrix product.
    qg = q.float().view(bsz, tq, hkv, group, dim).permute(0, 2, 3, 1, 4).reshape(bsz, hkv, group * tq, dim)
    kt = k.float().permute(0, 2, 3, 1)  # [B, Hkv, D, Tk]
    scores = torch.matmul(qg, kt) * scale  # [B, Hkv, G*Tq, Tk]
    if mask is not None:
        m = mask[:, None, None, :, :].expand(bsz, 1, group, tq, mask.shape[-1])
        scores = scores.masked_fill(~m.reshape(bsz, 1, group * tq, -1), NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G*Tq]
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse[..., None])
    o = torch.matmul(probs, v.float().permute(0, 2, 1, 3))  # [B, Hkv, G*Tq, D]
    o = o.view(bsz, hkv, group, tq, dim).permute(0, 3, 1, 2, 4).reshape(bsz, tq, hq, dim)
    lse = lse.view(bsz, hkv, group, tq).permute(0, 3, 1, 2).reshape(bsz, tq, hq)
    return o.to(q.dtype), lse


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Exact softmax over the union of two disjoint key sets (the relay fusion).

    o_* [..., H, D], lse_* [..., H] fp32. w = sigmoid(lse_a - lse_b) = Z_a / (Z_a + Z_b).
    """
    w = torch.sigmoid(lse_a - lse_b)
    w = torch.where(torch.isneginf(lse_a), torch.zeros_like(w), w)  # also covers both empty
    w = w[..., None]
    return (w * o_a.float() + (1.0 - w) * o_b.float()).to(o_a.dtype)


def system_attention(q: torch.Tensor, k_sys: torch.Tensor, v_sys: torch.Tensor,
                     scale: float, attend: AttendLSE = attention_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """All queries of a batch against one shared system prefix, non-causal.

    q [N, Hq, D], k_sys/v_sys [S, Hkv, D] -> o [N, Hq, D], lse [N, Hq] fp32.
    The N queries and the G heads of each KV head are stacked into one [N*G, D]
    matrix, so K_S and V_S are read once for the whole batch (matrix-matrix work).
    """
    o, lse = attend(q[None], k_sys[None], v_sys[None], scale)
    return o[0], lse[0]


def gather_context(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Own keys (or values) of each sequence, padded: [B, C_max, Hkv, D]."""
    slots = meta.padded_indices()["ctx_slots"]
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    # index_select on the flat slot list: 2-D advanced indexing of a large cache is far slower on CPU.
    return flat.index_select(0, slots.flatten()).view(*slots.shape, cache.shape[-2], cache.shape[-1])


def _pad_queries(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    idx = meta.padded_indices()
    q_pad = q.new_zeros(meta.num_seqs, meta.max_seqlen_q, q.shape[1], q.shape[2])
    q_pad[idx["query_seq"], idx["query_local"]] = q
    return q_pad


def _causal_mask(meta: AttentionMetadata, num_prefix: int = 0) -> torch.Tensor:
    """[B, Tq_max, num_prefix + C_max]: prefix keys always visible, own keys causal."""
    idx = meta.padded_indices()
    q_pos = torch.full((meta.num_seqs, meta.max_seqlen_q), -1, dtype=torch.int64,
                       device=meta.context_lens.device)
    q_pos[idx["query_seq"], idx["query_local"]] = idx["query_ctx_pos"]
    cols = torch.arange(meta.max_context_len, device=q_pos.device)
    own = (cols[None, None, :] <= q_pos[:, :, None]) & idx["ctx_valid"][:, None, :]
    if num_prefix == 0:
        return own
    pre = (q_pos >= 0)[:, :, None].expand(-1, -1, num_prefix)
    return torch.cat([pre, own], dim=-1)


def context_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float,
                      attend: AttendLSE = attention_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's queries against its own paged keys, causal.

    q [N, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] -> o [N, Hq, D], lse [N, Hq].
    """
    idx = meta.padded_indices()
    o, lse = attend(_pad_queries(q, meta), gather_context(k_cache, meta),
                    gather_context(v_cache, meta), scale, _causal_mask(meta))
    return o[idx["query_seq"], idx["query_local"]], lse[idx["query_seq"], idx["query_local"]]


def listed_groups(meta: AttentionMetadata, prefixes: list[tuple[torch.Tensor, torch.Tensor]]) -> list[PrefixGroup]:
    """The step's prefix groups as lists: meta.prefix_groups, or its PrefixTable read back
    (a group's first key in the store names its slot)."""
    table = meta.prefix_table
    if table is None:
        return meta.prefix_groups
    layer = prefixes if isinstance(prefixes, LayerPrefixes) else LayerPrefixes(prefixes)
    starts = {start: slot for slot, (start, rows) in enumerate(layer.ranges()) if rows}
    device = meta.context_lens.device
    out = []
    for row_lo, row_hi, key0, keys in table.groups.tolist()[:table.num_groups]:
        if row_hi > row_lo:
            rows = torch.arange(row_lo, row_hi, device=device)
            out.append(PrefixGroup(starts[key0], keys, rows, rows))  # decode: row b is query b
    return out


def relay_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, prefixes: list[tuple[torch.Tensor, torch.Tensor]],
                    scale: float, attend: AttendLSE = attention_lse) -> torch.Tensor:
    """RelayAttention: system step per shared prefix, context step, exact fusion.

    prefixes[slot] = (k_sys [S, Hkv, D], v_sys [S, Hkv, D]) for this layer.
    Returns o [N, Hq, D].
    """
    o_ctx, lse_ctx = context_attention(q, k_cache, v_cache, meta, scale, attend)
    groups = listed_groups(meta, prefixes)
    if not groups:
        return o_ctx
    o_sys = torch.zeros_like(o_ctx)
    lse_sys = torch.full_like(lse_ctx, NEG_INF)
    for group in groups:
        k_sys, v_sys = prefixes[group.prefix_slot]
        rows = group.query_indices
        o_g, lse_g = system_attention(q[rows], k_sys, v_sys, scale, attend)
        o_sys[rows] = o_g
        lse_sys[rows] = lse_g
    return merge_attention(o_sys, lse_sys, o_ctx, lse_ctx)


def prefix_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, prefixes: list[tuple[torch.Tensor, torch.Tensor]],
                           scale: float, attend: AttendLSE = attention_lse) -> torch.Tensor:
    """The --no-relay baseline: one softmax per request over its prefix and own keys.

    The prefix is shared in memory but read once per request (vLLM prefix caching).
    Returns o [N, Hq, D].
    """
    idx = meta.padded_indices()
    q_pad = _pad_queries(q, meta)
    k_own, v_own = gather_context(k_cache, meta), gather_context(v_cache, meta)
    o_pad = torch.empty_like(q_pad)
    grouped = torch.zeros(meta.num_seqs, dtype=torch.bool, device=q.device)
    for group in listed_groups(meta, prefixes):
        k_sys, v_sys = prefixes[group.prefix_slot]
        seqs = group.seq_indices
        grouped[seqs] = True
        num = seqs.shape[0]
        k = torch.cat([k_sys[None].expand(num, -1, -1, -1), k_own[seqs]], dim=1)
        v = torch.cat([v_sys[None].expand(num, -1, -1, -1), v_own[seqs]], dim=1)
        mask = _causal_mask(meta, group.num_prefix_tokens)[seqs]
        o_pad[seqs] = attend(q_pad[seqs], k, v, scale, mask)[0]
    rest = torch.nonzero(~grouped).flatten()
    if rest.numel():
        mask = _causal_mask(meta)[rest]
        o_pad[rest] = attend(q_pad[rest], k_own[rest], v_own[rest], scale, mask)[0]
    return o_pad[idx["query_seq"], idx["query_local"]]


def check_kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """What storing k/v [N, Hkv, D] at flat slots of [num_blocks, block_size, Hkv, D] caches needs."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [num_blocks, block_size, Hkv, D]"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous to be viewed flat"
    assert k.shape == v.shape and k.dim() == 3 and k.shape[1:] == k_cache.shape[2:], \
        f"k/v must be [N, Hkv, D] = [N, {k_cache.shape[2]}, {k_cache.shape[3]}], got {tuple(k.shape)}"
    assert slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype == torch.int64, "slot_mapping must be [N] int64"
    assert slot_mapping.device == k_cache.device == k.device, "everything must be on one device"


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's k/v [N, Hkv, D] at their flat slots of the paged cache."""
    k_cache.view(-1, k.shape[1], k.shape[2]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, v.shape[1], v.shape[2]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal_offset: int) -> torch.Tensor:
    """Textbook attention in float64 for one sequence, the check for everything above.

    q [Tq, Hq, D], k/v [Tk, Hkv, D]; query i sees keys j <= causal_offset + i.
    """
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    tq, tk = q.shape[0], k.shape[0]
    allowed = torch.arange(tk)[None, :] <= (causal_offset + torch.arange(tq))[:, None]
    scores = scores.masked_fill(~allowed[None], NEG_INF)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)

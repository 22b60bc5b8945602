"""Random paged-attention problems shared by the kernel tests."""

from __future__ import annotations

import torch

from relaycli.kernels.metadata import AttentionMetadata, PrefixGroup


def random_problem(*, q_lens: list[int], ctx_lens: list[int], prefix_of: list[int],
                   prefix_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int = 16, dtype=torch.float32, device="cpu", generator=None):
    """Build caches, prefixes and metadata for sequences with the given shapes.

    q_lens[b] new queries, ctx_lens[b] own keys (>= q_lens[b]), prefix_of[b] the prefix
    slot of sequence b or a value >= len(prefix_lens) for none. Blocks are shuffled so
    that paging is exercised.
    """
    g = generator
    num_seqs = len(q_lens)
    blocks_per_seq = [(c + block_size - 1) // block_size for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(max(blocks_per_seq), 1)
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    nxt = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = torch.tensor(perm[nxt:nxt + nb], dtype=torch.int32)
        nxt += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    prefixes = [(torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype).to(device),
                 torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype).to(device))
                for s in prefix_lens]
    num_queries = sum(q_lens)
    q = torch.randn(num_queries, num_q_heads, head_dim, generator=g).to(dtype).to(device)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = []
    for b in range(num_seqs):
        for j in range(ctx_lens[b] - q_lens[b], ctx_lens[b]):
            slots.append(int(block_tables[b, j // block_size]) * block_size + j % block_size)
    groups = []
    for slot, s in enumerate(prefix_lens):
        seqs = [b for b in range(num_seqs) if prefix_of[b] == slot]
        if not seqs:
            continue
        rows = [n for b in seqs for n in range(int(cu[b]), int(cu[b + 1]))]
        groups.append(PrefixGroup(slot, s, torch.tensor(seqs, device=device),
                                  torch.tensor(rows, device=device)))
    meta = AttentionMetadata(
        is_decode=all(n == 1 for n in q_lens), cu_seqlens_q=cu.to(device), max_seqlen_q=max(q_lens),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        max_context_len=max(ctx_lens), block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_size=block_size,
        prefix_groups=groups)
    return q, k_cache, v_cache, prefixes, meta


def expected_output(q, k_cache, v_cache, prefixes, meta, prefix_of, scale):
    """float64 textbook attention over concatenated prefix + own keys, per sequence."""
    from relaycli.kernels.reference import naive_attention
    outs = []
    flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    bs = meta.block_size
    for b in range(meta.num_seqs):
        lo, hi = int(meta.cu_seqlens_q[b]), int(meta.cu_seqlens_q[b + 1])
        c = int(meta.context_lens[b])
        slots = [int(meta.block_tables[b, j // bs]) * bs + j % bs for j in range(c)]
        k, v = flat_k[slots], flat_v[slots]
        s = 0
        if prefix_of[b] < len(prefixes):
            pk, pv = prefixes[prefix_of[b]]
            k, v, s = torch.cat([pk, k]), torch.cat([pv, v]), pk.shape[0]
        outs.append(naive_attention(q[lo:hi], k, v, scale, s + c - (hi - lo)))
    return torch.cat(outs)

"""The paged context kernel (kernels/triton_context_attention.py: own keys through the block
table, causal, split into chunks, the relay merge in its epilogue) against
kernels/reference.py and float64. Inputs are fresh random draws on every run."""

import random

import pytest
import torch

from tests.helpers_attention import random_problem
from tests.helpers_kernels import DEVICE, TOL, baseline_with, gpu, interpret_on_cpu, make, rel_err, shapes, textbook

interpret_on_cpu()

from relaycli.kernels import reference as ref  # noqa: E402
from relaycli.kernels.tiles import Tile  # noqa: E402
from relaycli.kernels.triton_context_attention import context_attention, paged_attention  # noqa: E402
from relaycli.kernels.triton_ops import write_kv  # noqa: E402

SMALL_CTX = Tile(16, 16, 4, 2)  # many tiles, so splits really cut


def context_with(q, kc, vc, meta, scale, tile):
    """o, lse of one unsplit paged launch with this tile."""
    out = torch.empty((1,) + tuple(q.shape), dtype=q.dtype, device=q.device)
    lse = torch.empty((1,) + tuple(q.shape[:2]), dtype=torch.float32, device=q.device)
    paged_attention(q, kc, vc, meta, scale, out=out, lse=lse, tile=tile)
    return out[0], lse[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("decode", [True, False])
def test_context_attention_and_fused_merge(dtype, decode):
    q, kc, vc, prefixes, meta, scale = make(shapes(random.Random(), decode), dtype)
    want_o, want_lse = ref.context_attention(q.float(), kc.float(), vc.float(), meta, scale)
    o, lse = context_attention(q, kc, vc, meta, scale)
    assert rel_err(o, want_o) < TOL[dtype]
    assert torch.allclose(lse, want_lse, atol=1e-4, rtol=1e-5)
    # fusion: random system results, one row with no prefix (lse = -inf, o garbage-free zeros)
    o_sys = torch.randn_like(q)
    lse_sys = torch.randn(lse.shape, device=DEVICE) * 3
    lse_sys[0] = float("-inf")
    fused, fused_lse = context_attention(q, kc, vc, meta, scale, o_sys=o_sys, lse_sys=lse_sys)
    want = ref.merge_attention(o_sys.float(), lse_sys, want_o, want_lse)
    assert rel_err(fused, want) < TOL[dtype]
    assert torch.allclose(fused_lse, torch.logaddexp(lse_sys, want_lse), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_context_splits_cut_each_sequence_into_balanced_chunks(dtype):
    """Split s of a sequence with K own keys holds keys [s*per, min((s+1)*per, K)), per = cdiv(K, splits)
    in whole key tiles, from the sequence's own length (not the longest's): each split's partial is
    float64 attention over exactly that chunk, and a chunk past K is empty (o = 0, lse = -inf)."""
    rng = random.Random()
    shape = shapes(rng, decode=True)
    shape["ctx_lens"] = [rng.randint(1, 150) for _ in shape["ctx_lens"]]
    q, kc, vc, _, meta, scale = make(shape, dtype)
    splits, tile = rng.choice([2, 3, 5]), SMALL_CTX.block_n
    out = torch.empty(splits, *q.shape, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(splits, *q.shape[:2], dtype=torch.float32, device=DEVICE)
    paged_attention(q, kc, vc, meta, scale, out=out, lse=lse, num_splits=splits, tile=SMALL_CTX)
    keys, values = (ref.gather_context(c, meta).cpu().double() for c in (kc, vc))
    group = q.shape[1] // kc.shape[2]
    got_o, want_o, got_lse, want_lse = [], [], [], []
    for b, length in enumerate(shape["ctx_lens"]):
        per = -(-(-(-length // splits)) // tile) * tile
        for s in range(splits):
            lo, hi = s * per, min((s + 1) * per, length)
            if lo >= hi:
                assert torch.all(lse[s, b] == float("-inf")) and torch.all(out[s, b] == 0), (b, s, length)
                continue
            k = keys[b, lo:hi].repeat_interleave(group, dim=1)  # [keys, Hq, D]
            v = values[b, lo:hi].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[b].cpu().double(), k) * scale
            want_lse.append(torch.logsumexp(scores, dim=1))
            want_o.append(torch.einsum("hk,khd->hd", torch.softmax(scores, dim=1), v))
            got_o.append(out[s, b].cpu())
            got_lse.append(lse[s, b].cpu())
    assert rel_err(torch.stack(got_o), torch.stack(want_o)) < TOL[dtype]
    assert torch.allclose(torch.stack(got_lse).double(), torch.stack(want_lse), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("decode", [True, False])
def test_block_ids_read_ahead_give_the_same_bits(dtype, decode):
    """bt_ahead (each tile's block ids loaded one iteration early, for the software
    pipeline) reads the same tiles in the same order: the baseline, split or not, and the
    context step give the same bits as without it, and match float64 attention."""
    shape = shapes(random.Random(), decode)
    q, kc, vc, prefixes, meta, scale = make(shape, dtype)
    want = textbook(shape, q, kc, vc, prefixes, meta, scale)
    for splits in (None, 3):
        got = [baseline_with(q, kc, vc, meta, prefixes, scale, splits, SMALL_CTX.replace(bt_ahead=a))
               for a in (False, True)]
        assert torch.equal(got[0], got[1])
        assert rel_err(got[1], want) < TOL[dtype]
    plain, ahead = (context_with(q, kc, vc, meta, scale, SMALL_CTX.replace(bt_ahead=a)) for a in (False, True))
    assert torch.equal(plain[0], ahead[0]) and torch.equal(plain[1], ahead[1])


def test_write_kv_matches_reference():
    q, kc, vc, prefixes, meta, scale = make(shapes(random.Random(), decode=False), torch.float16)
    k_new = torch.randn(meta.num_queries, kc.shape[2], kc.shape[3], device=DEVICE)
    v_new = torch.randn_like(k_new)
    want_k, want_v = kc.clone(), vc.clone()
    ref.write_kv(want_k, want_v, k_new, v_new, meta.slot_mapping)
    write_kv(kc, vc, k_new, v_new, meta.slot_mapping)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_paged_launchers_reject_bad_inputs():
    q, kc, vc, prefixes, meta, scale = make(shapes(random.Random(), decode=True), torch.float32)
    with pytest.raises(AssertionError, match="dtypes differ"):
        context_attention(q.half(), kc, vc, meta, scale)
    with pytest.raises(AssertionError, match="unit last stride"):
        context_attention(q, kc.transpose(-1, -2), vc.transpose(-1, -2), meta, scale)
    with pytest.raises(AssertionError, match="slot_mapping"):
        write_kv(kc, vc, q[:, :kc.shape[2]], q[:, :kc.shape[2]], meta.slot_mapping.int())
    with pytest.raises(AssertionError, match="num_splits must be at least 1"):
        paged_attention(q, kc, vc, meta, scale, out=torch.empty(1, *q.shape, device=DEVICE), num_splits=0,
                        tile=SMALL_CTX)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_short_context_tile_with_its_register_cap_gives_the_same_bits(dtype):
    """Relay's decode context step over short own contexts (the capped 32-key tile) writes the
    same bits with and without the cap, and matches the float64 reference."""
    from relaycli.kernels.triton_plan import paged_config
    rng = random.Random()
    n = rng.randint(80, 300)
    q, kc, vc, _, meta = random_problem(q_lens=[1] * n, ctx_lens=[rng.randint(1, 500) for _ in range(n)],
                                        prefix_of=[1] * n, prefix_lens=[], num_q_heads=32, num_kv_heads=8,
                                        head_dim=128, dtype=dtype, device="cuda")
    capped = paged_config(4, 128, q.device, q.element_size(), meta.max_context_len)
    assert capped.maxnreg == 128, capped
    outs = [context_with(q, kc, vc, meta, 128 ** -0.5, tile) for tile in (capped, capped.replace(maxnreg=None))]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    want, _ = ref.context_attention(q.double(), kc.double(), vc.double(), meta, 128 ** -0.5)
    assert rel_err(outs[0][0], want) < TOL[dtype]

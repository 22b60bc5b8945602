"""Triton attention kernels against kernels/reference.py and float64 textbook attention.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small fp32/fp16 shapes (the
interpreter gets bf16 tl.dot wrong); with CUDA, larger shapes in bf16/fp16/fp32 too.
Inputs are fresh random draws on every run.
"""

import dataclasses
import functools
import importlib
import math
import os
import random
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

_MODULES = ["relaycli.kernels.triton_system_attention", "relaycli.kernels.triton_context_attention",
            "relaycli.kernels.triton_grouped_system", "relaycli.kernels.triton_paged_decode", "relaycli.kernels.triton_ops"]
# @triton.jit picks interpreter or compiler at import: re-import modules someone loaded earlier
for _name in _MODULES:
    if _name in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        importlib.reload(sys.modules[_name])

from relaycli.kernels import reference as ref  # noqa: E402
from relaycli.kernels.metadata import LayerPrefixes, PrefixTable, prefix_table_rows  # noqa: E402
from relaycli.kernels.pdl import pdl_supported  # noqa: E402
from relaycli.kernels.triton_context_attention import context_attention, paged_attention  # noqa: E402
from relaycli.kernels.triton_paged_decode import prefix_paged_attention as baseline_with  # noqa: E402
from relaycli.kernels.triton_ops import prefix_paged_attention, relay_attention, relay_attention_with, write_kv  # noqa: E402
from relaycli.kernels.triton_system_attention import merge_partials, system_attention  # noqa: E402
from tests.helpers_attention import expected_output, random_problem  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}  # relative L2 error
SMALL_CTX = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2)  # many tiles, so splits really cut


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all(), "non-finite output (unwritten or NaN)"
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def shapes(rng: random.Random, decode: bool, big: bool = False) -> dict:
    num_kv = rng.choice([1, 2] if not big else [2, 4, 8])
    group = rng.choice([1, 3, 4])
    num_seqs = rng.randint(1, 5) if not big else rng.randint(20, 48)
    ctx = [rng.randint(1, 60 if not big else 700) for _ in range(num_seqs)]
    q_lens = [1 if decode else rng.randint(1, c) for c in ctx]
    prefix_lens = [rng.randint(1, 180 if not big else 3000), rng.randint(1, 40 if not big else 400)]
    prefix_of = [rng.choice([0, 0, 1, 2]) for _ in range(num_seqs)]  # 2 = no prefix
    return dict(q_lens=q_lens, ctx_lens=ctx, prefix_of=prefix_of, prefix_lens=prefix_lens,
                num_q_heads=num_kv * group, num_kv_heads=num_kv, head_dim=rng.choice([16, 32] if not big else [64, 128]),
                block_size=rng.choice([4, 16]))


def make(shape: dict, dtype: torch.dtype):
    q, kc, vc, prefixes, meta = random_problem(**shape, dtype=dtype, device=DEVICE)
    return q, kc, vc, prefixes, meta, 1.0 / math.sqrt(shape["head_dim"])


def upcast(q, kc, vc, prefixes):
    return q.float(), kc.float(), vc.float(), [(k.float(), v.float()) for k, v in prefixes]


def textbook(shape, q, kc, vc, prefixes, meta, scale) -> torch.Tensor:
    """float64 attention over prefix + own keys, computed on the CPU."""
    cpu = lambda t: t.detach().cpu().double()  # noqa: E731
    meta_cpu = dataclasses.replace(meta, cu_seqlens_q=meta.cu_seqlens_q.cpu(), context_lens=meta.context_lens.cpu(),
                                   block_tables=meta.block_tables.cpu(), slot_mapping=meta.slot_mapping.cpu(),
                                   prefix_groups=[], _cache={})
    want = expected_output(cpu(q), cpu(kc), cpu(vc), [(cpu(k), cpu(v)) for k, v in prefixes], meta_cpu,
                           shape["prefix_of"], scale)
    return want.to(q.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("tma", [False, True])
def test_system_attention(dtype, splits, tma):
    rng = random.Random()
    hkv, group, d = rng.choice([1, 2]), rng.choice([1, 3, 4]), rng.choice([16, 32])
    n, s = rng.randint(1, 40), rng.randint(1, 300)
    q = torch.randn(n, hkv * group, d, device=DEVICE).to(dtype)
    k, v = (torch.randn(s, hkv, d, device=DEVICE).to(dtype) for _ in range(2))
    config = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2, tma=True) if tma else None
    o, lse = system_attention(q, k, v, 0.2, num_splits=splits, config=config)
    want_o, want_lse = ref.system_attention(q.float(), k.float(), v.float(), 0.2)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(o, want_o) < TOL[dtype]
    assert torch.allclose(lse, want_lse, atol=1e-4, rtol=1e-5)
    row = rng.randrange(n)
    naive = ref.naive_attention(q[row:row + 1].cpu(), k.cpu(), v.cpu(), 0.2, s)
    assert rel_err(o[row:row + 1].cpu(), naive) < TOL[dtype]


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
    splits, tile = rng.choice([2, 3, 5]), SMALL_CTX["BLOCK_N"]
    out = torch.empty(splits, *q.shape, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(splits, *q.shape[:2], dtype=torch.float32, device=DEVICE)
    paged_attention(q, kc, vc, meta, scale, out=out, lse=lse, num_splits=splits, config=SMALL_CTX)
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
@pytest.mark.parametrize("mode", ["default", "split", "fused-6", "overlap", "overlap-system-side",
                                  "overlap-context-first"])
def test_relay_attention(dtype, decode, mode):
    rng = random.Random()
    shape = shapes(rng, decode)
    if mode == "fused-6":  # 16-key tiles over 81-96 keys: six non-empty system splits
        shape["prefix_lens"] = [rng.randint(81, 96), rng.randint(81, 96)]
    q, kc, vc, prefixes, meta, scale = make(shape, dtype)
    if mode == "fused-6":  # six partials folded in by the context epilogue: a full and a partial chunk
        got = relay_attention_with(q, kc, vc, meta, prefixes, scale, sys_splits=6, ctx_splits=1,
                                   sys_config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2))
    elif mode == "split":  # system split 3 ways, context split 2 ways: partials meet in the merge kernel
        got = relay_attention_with(q, kc, vc, meta, prefixes, scale, sys_splits=3, ctx_splits=2, ctx_config=SMALL_CTX)
    elif mode == "overlap":  # context as one more partial (the other stream on CUDA), then the merge kernel
        got = relay_attention_with(q, kc, vc, meta, prefixes, scale, overlap=True)
    elif mode == "overlap-system-side":  # the system kernel first (the overlap's default), at most one an SM
        got = relay_attention_with(q, kc, vc, meta, prefixes, scale, overlap=True, system_side=True, resident=True)
    elif mode == "overlap-context-first":  # the context kernel first, the system split for two programs an SM
        got = relay_attention_with(q, kc, vc, meta, prefixes, scale, overlap=True, system_side=False, resident=False)
    else:
        got = relay_attention(q, kc, vc, meta, prefixes, scale)
        with pytest.raises(AssertionError, match="fused"):  # only None (the plan's) or False (never)
            relay_attention_with(q, kc, vc, meta, prefixes, scale, fused=True)
    assert got.shape == q.shape and got.dtype == dtype
    assert rel_err(got, ref.relay_attention(*upcast(q, kc, vc, prefixes)[:3], meta,
                                            upcast(q, kc, vc, prefixes)[3], scale)) < TOL[dtype]
    assert rel_err(got, textbook(shape, q, kc, vc, prefixes, meta, scale)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("splits", [None, 3])
def test_prefix_paged_attention(dtype, decode, splits):
    shape = shapes(random.Random(), decode)
    q, kc, vc, prefixes, meta, scale = make(shape, dtype)
    if splits is None:
        got = prefix_paged_attention(q, kc, vc, meta, prefixes, scale)
    else:
        got = baseline_with(q, kc, vc, meta, prefixes, scale, num_splits=splits, config=SMALL_CTX)
    qf, kf, vf, pf = upcast(q, kc, vc, prefixes)
    assert rel_err(got, ref.prefix_paged_attention(qf, kf, vf, meta, pf, scale)) < TOL[dtype]
    assert rel_err(got, textbook(shape, q, kc, vc, prefixes, meta, scale)) < TOL[dtype]


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
        got = [baseline_with(q, kc, vc, meta, prefixes, scale, num_splits=splits, config=dict(SMALL_CTX, bt_ahead=a))
               for a in (False, True)]
        assert torch.equal(got[0], got[1])
        assert rel_err(got[1], want) < TOL[dtype]
    plain, ahead = (context_attention(q, kc, vc, meta, scale, config=dict(SMALL_CTX, bt_ahead=a)) for a in (False, True))
    assert torch.equal(plain[0], ahead[0]) and torch.equal(plain[1], ahead[1])


@pytest.mark.parametrize("splits", [1, 3, 4, 9])
def test_merge_partials_weights_each_split_by_its_lse_whatever_the_unroll(splits):
    """The merge is the softmax over all splits' keys: o = sum_s exp(lse_s - lse) o_s with
    lse = logsumexp_s lse_s; a split with lse = -inf adds nothing even if its o is NaN, a
    row whose splits are all empty gives (0, -inf); loading 1, 3 or 4 splits at a time,
    or as many as the plan picks for the grid, gives the same bits."""
    n, heads, d = 5, 6, 32
    o_part = torch.randn(splits, n, heads, d, device=DEVICE)
    lse_part = torch.randn(splits, n, heads, device=DEVICE) * 4
    empty = torch.rand(splits, n, heads, device=DEVICE) < 0.3
    lse_part[empty] = float("-inf")
    o_part[empty] = float("nan")
    lse_part[:, 0, 0] = float("-inf")  # a row with no keys at all
    got = {u: merge_partials(o_part, lse_part, torch.float32, unroll=u) for u in (1, 3, 4, None)}
    for u in (3, 4, None):
        assert torch.equal(got[u][0], got[1][0]) and torch.equal(got[u][1], got[1][1])
    # any number of heads a program (the last block part empty at 4 of 6), any warps: the same bits
    for block_h, warps in ((1, 4), (2, 1), (4, 2), (8, 4)):
        o_b, lse_b = merge_partials(o_part, lse_part, torch.float32, block_h=block_h, num_warps=warps)
        assert torch.equal(o_b, got[1][0]) and torch.equal(lse_b, got[1][1]), (block_h, warps)
    # one row is a small grid, so the plan's choice there is 4 in flight (5 rows: 1 on CPU)
    one = [merge_partials(o_part[:, :1], lse_part[:, :1], torch.float32, unroll=u) for u in (1, None)]
    assert torch.equal(one[0][0], one[1][0]) and torch.equal(one[0][1], one[1][1])
    assert torch.equal(one[1][0], got[1][0][:1]) and torch.equal(one[1][1], got[1][1][:1])
    o, lse = got[1]
    lse64 = lse_part.double().cpu()
    want_lse = torch.logsumexp(lse64, dim=0)
    w = torch.exp(lse64 - torch.where(torch.isneginf(want_lse), 0.0, want_lse)).nan_to_num(0.0)
    want_o = (w[..., None] * o_part.double().cpu().nan_to_num(0.0)).sum(0)
    assert torch.equal(lse[0, 0].cpu(), torch.tensor(float("-inf"))) and torch.all(o[0, 0] == 0)
    assert torch.allclose(lse.cpu().double(), want_lse, atol=1e-5, rtol=1e-5)
    assert torch.allclose(o.cpu().double(), want_o, atol=1e-5, rtol=1e-5)
    # as a programmatic dependent (sm_90): the same bits; elsewhere refused, not run plainly
    if CUDA and pdl_supported(torch.device(DEVICE)):
        o_w, lse_w = merge_partials(o_part, lse_part, torch.float32, pdl=True)
        assert torch.equal(o_w, o) and torch.equal(lse_w, lse)
    else:
        with pytest.raises(AssertionError, match="pdl needs"):
            merge_partials(o_part, lse_part, torch.float32, pdl=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_padding_rows_read_nothing_and_leave_the_other_rows_alone(dtype):
    """A decode row with context_len 0 is padding (a CUDA graph's rows past the batch):
    the baseline must not read its prefix (that would make --no-relay pay for padding),
    its output is 0, and every real row is unchanged in both systems."""
    rng = random.Random()
    shape = shapes(rng, decode=True)
    shape["prefix_of"] = [0] * len(shape["q_lens"])
    q, kc, vc, prefixes, meta, scale = make(shape, dtype)
    pad = sorted(rng.sample(range(len(shape["q_lens"])), rng.randint(1, len(shape["q_lens"]))))
    want_base = prefix_paged_attention(q, kc, vc, meta, prefixes, scale)
    want_relay = relay_attention(q, kc, vc, meta, prefixes, scale)
    meta.context_lens[pad] = 0
    real = [b for b in range(len(shape["q_lens"])) if b not in pad]
    for splits in (None, 3):
        got = baseline_with(q, kc, vc, meta, prefixes, scale, num_splits=splits, config=SMALL_CTX)
        assert torch.equal(got[pad], torch.zeros_like(got[pad]))
        if real:
            assert rel_err(got[real], want_base[real]) < TOL[dtype]
    for mode in ("default", "overlap"):
        got = relay_attention_with(q, kc, vc, meta, prefixes, scale, overlap=mode == "overlap")
        assert torch.isfinite(got).all()  # padding keeps its system part; it is dropped anyway
        if real:
            assert rel_err(got[real], want_relay[real]) < TOL[dtype]


def table_problem(rng: random.Random, dtype: torch.dtype, num_groups: int):
    """A decode step whose rows use several prefixes, ordered by group (rows without a
    prefix last, some padding rows past the batch), with its PrefixTable over a store."""
    num_kv, group = rng.choice([(1, 1), (2, 3), (2, 4)])
    prefix_lens = [rng.randint(1, 150) for _ in range(rng.randint(2, 5))]
    order = sorted(rng.sample(range(len(prefix_lens)), rng.randint(1, min(num_groups, len(prefix_lens)))))
    rng.shuffle(order)
    prefix_of = [slot for slot in order for _ in range(rng.randint(1, 7))]
    prefix_of += [len(prefix_lens)] * rng.randint(0, 3)  # no prefix
    n = len(prefix_of)
    pad = rng.randint(0, 3)
    ctx = [rng.randint(1, 40) for _ in range(n)] + [1] * pad
    q, kc, vc, prefixes, meta = random_problem(q_lens=[1] * (n + pad), ctx_lens=ctx,
                                               prefix_of=prefix_of + [len(prefix_lens)] * pad,
                                               prefix_lens=prefix_lens, num_q_heads=num_kv * group,
                                               num_kv_heads=num_kv, head_dim=rng.choice([16, 32]),
                                               block_size=rng.choice([4, 16]), dtype=dtype, device=DEVICE)
    meta.context_lens[n:] = 0  # padding rows: no own keys, no prefix, outputs dropped
    layer = LayerPrefixes.stored(prefixes)
    slots = [s if s < len(prefix_lens) else None for s in prefix_of] + [None] * pad
    row_group, rows = prefix_table_rows(slots, prefix_lens, num_groups)
    table = PrefixTable(torch.tensor(row_group, dtype=torch.int32, device=DEVICE),
                        torch.tensor(rows, dtype=torch.int32, device=DEVICE), num_groups, max(prefix_lens),
                        rng.choice([1, 2, 3]))
    tabled = dataclasses.replace(meta, prefix_groups=[], prefix_table=table, _cache={})
    return q, kc, vc, layer, meta, tabled, n, 1.0 / math.sqrt(q.shape[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_a_prefix_table_step_equals_the_step_with_its_groups_listed(dtype, seed):
    """Rows of several prefixes in one step, described as device data (one grouped system
    launch over the prefix store; the baseline one launch reading each row's prefix range)
    give what the per-group launches give, for relay and the baseline alike."""
    rng = random.Random(seed)
    q, kc, vc, layer, meta, tabled, n, scale = table_problem(rng, dtype, num_groups=rng.choice([5, 8]))
    qf, kf, vf, pf = upcast(q, kc, vc, list(layer))
    want_relay = ref.relay_attention(qf, kf, vf, meta, pf, scale)
    want_base = ref.prefix_paged_attention(qf, kf, vf, meta, pf, scale)
    for got, want in ((relay_attention(q, kc, vc, tabled, layer, scale), want_relay),
                      (relay_attention_with(q, kc, vc, tabled, layer, scale, overlap=True), want_relay),
                      (prefix_paged_attention(q, kc, vc, tabled, layer, scale), want_base),
                      (baseline_with(q, kc, vc, tabled, layer, scale, num_splits=2), want_base)):
        assert rel_err(got[:n], want[:n]) < TOL[dtype]


def test_prefix_table_rows_number_runs_and_refuse_unordered_rows():
    row_group, rows = prefix_table_rows([2, 2, 0, None, None], [5, 7, 3], 3)
    assert row_group == [0, 0, 1, 3, 3]
    assert rows == [(0, 2, 12, 3), (2, 3, 0, 5), (0, 0, 0, 0), (0, 0, 0, 0)]
    with pytest.raises(ValueError, match="last"):
        prefix_table_rows([None, 0], [5], 2)
    with pytest.raises(ValueError, match="not together"):
        prefix_table_rows([0, 1, 0], [5, 5], 4)
    with pytest.raises(ValueError, match="holds 1"):
        prefix_table_rows([0, 1], [5, 5], 1)


def test_relay_without_prefix_groups_is_context_attention():
    shape = shapes(random.Random(), decode=False)
    q, kc, vc, prefixes, meta, scale = make(shape, torch.float32)
    meta.prefix_groups = []
    got = relay_attention(q, kc, vc, meta, prefixes, scale)
    assert rel_err(got, ref.context_attention(q, kc, vc, meta, scale)[0]) < 1e-4
    assert rel_err(prefix_paged_attention(q, kc, vc, meta, prefixes, scale), got) < 1e-4


def test_write_kv_matches_reference():
    q, kc, vc, prefixes, meta, scale = make(shapes(random.Random(), decode=False), torch.float16)
    k_new = torch.randn(meta.num_queries, kc.shape[2], kc.shape[3], device=DEVICE)
    v_new = torch.randn_like(k_new)
    want_k, want_v = kc.clone(), vc.clone()
    ref.write_kv(want_k, want_v, k_new, v_new, meta.slot_mapping)
    write_kv(kc, vc, k_new, v_new, meta.slot_mapping)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_launchers_reject_bad_inputs():
    q, kc, vc, prefixes, meta, scale = make(shapes(random.Random(), decode=True), torch.float32)
    with pytest.raises(AssertionError, match="dtypes differ"):
        relay_attention(q.half(), kc, vc, meta, prefixes, scale)
    with pytest.raises(AssertionError, match="unit last stride"):
        relay_attention(q, kc.transpose(-1, -2), vc.transpose(-1, -2), meta, prefixes, scale)
    gqa = dict(shapes(random.Random(), decode=True), num_q_heads=4, num_kv_heads=2)
    q2, kc2, vc2, _, meta2, _ = make(gqa, torch.float32)
    with pytest.raises(AssertionError, match="not a multiple"):
        prefix_paged_attention(q2[:, :3].contiguous(), kc2, vc2, meta2, [], scale)
    with pytest.raises(AssertionError, match="k_sys"):
        system_attention(q, prefixes[0][0][:, :, :8], prefixes[0][1], scale)
    with pytest.raises(AssertionError, match="slot_mapping"):
        write_kv(kc, vc, q[:, :kc.shape[2]], q[:, :kc.shape[2]], meta.slot_mapping.int())
    with pytest.raises(AssertionError, match="num_splits must be at least 1"):
        paged_attention(q, kc, vc, meta, scale, out=torch.empty(1, *q.shape, device=DEVICE), num_splits=0)
    with pytest.raises(AssertionError, match="a power of two"):
        merge_partials(torch.zeros(2, 1, 6, 16, device=DEVICE), torch.zeros(2, 1, 6, device=DEVICE), q.dtype, block_h=3)
    with pytest.raises(AssertionError, match="unroll must be at least 1"):
        merge_partials(torch.zeros(2, 1, 1, 16, device=DEVICE), torch.zeros(2, 1, 1, device=DEVICE), q.dtype, unroll=0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_relay_and_baseline_large(dtype, decode):
    shape = shapes(random.Random(), decode, big=True)
    q, kc, vc, prefixes, meta, scale = make(shape, dtype)
    want = textbook(shape, q, kc, vc, prefixes, meta, scale)
    qf, kf, vf, pf = upcast(q, kc, vc, prefixes)
    want_relay = ref.relay_attention(qf, kf, vf, meta, pf, scale)
    for got, want_ref in ((relay_attention(q, kc, vc, meta, prefixes, scale), want_relay),
                          (relay_attention_with(q, kc, vc, meta, prefixes, scale, overlap=True), want_relay),
                          (relay_attention_with(q, kc, vc, meta, prefixes, scale, overlap=True, system_side=True),
                           want_relay),
                          (prefix_paged_attention(q, kc, vc, meta, prefixes, scale),
                           ref.prefix_paged_attention(qf, kf, vf, meta, pf, scale))):
        assert rel_err(got, want_ref) < TOL[dtype]
        assert rel_err(got, want) < TOL[dtype]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix, own, bucket, want_ws", [(8192, 128, None, True), (2048, 1000, None, False),
                                                         (4096, 32, 256, True)])
def test_gpu_graphed_relay_step_takes_the_warp_specialised_kernel_where_its_plan_says(dtype, prefix, own, bucket,
                                                                                       want_ws, monkeypatch):
    """A captured full-batch decode step (llama3-8b heads, batch 256) runs the warp-specialised
    Gluon kernel where the system step is the longer one, the 64-row one where it runs beside
    the context (triton_ops.plan_system), and both replay to the relay reference. bucket: the
    step is planned as a decode graph of that context bucket plans it, priced by the real own
    keys (meta.context_tokens); priced at the bucket's bound, 4,096 and 256 would take the
    64-row tile."""
    import relaycli.kernels.gluon_system_attention as gsa
    from relaycli.kernels.triton_plan import is_sm90
    if not is_sm90(torch.device("cuda")):
        pytest.skip("the warp-specialised system kernel is Gluon's, for sm_90")
    rng = random.Random()
    batch = 256
    ctx = [rng.randint(own // 2, own) for _ in range(batch)]
    q, kc, vc, prefixes, meta = random_problem(q_lens=[1] * batch, ctx_lens=ctx, prefix_of=[0] * batch,
                                               prefix_lens=[prefix], num_q_heads=32, num_kv_heads=8,
                                               head_dim=128, dtype=dtype, device="cuda")
    meta = dataclasses.replace(meta, graphed=True, _cache={})
    if bucket is not None:
        meta = dataclasses.replace(meta, max_context_len=bucket, context_tokens=sum(ctx), _cache={})
    scale = 128 ** -0.5
    kinds = []
    real = gsa.gluon_system_attention_into
    monkeypatch.setattr(gsa, "gluon_system_attention_into",
                        lambda *a, **kw: (kinds.append(kw["ws"]), real(*a, **kw))[1])
    out = torch.empty_like(q)
    out.copy_(relay_attention_with(q, kc, vc, meta, prefixes, scale))  # a graph's eager pass compiles its kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(relay_attention_with(q, kc, vc, meta, prefixes, scale))
    assert kinds and set(kinds) == {want_ws}, kinds
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    qf, kf, vf, pf = upcast(q, kc, vc, prefixes)
    assert rel_err(out, ref.relay_attention(qf, kf, vf, meta, pf, scale)) < TOL[dtype]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_short_context_tile_with_its_register_cap_gives_the_same_bits(dtype):
    """Relay's decode context step over short own contexts (the capped 32-key tile) writes the
    same bits with and without the cap, and matches the float64 reference."""
    from relaycli.kernels.triton_context_attention import paged_config
    rng = random.Random()
    n = rng.randint(80, 300)
    q, kc, vc, _, meta = random_problem(q_lens=[1] * n, ctx_lens=[rng.randint(1, 500) for _ in range(n)],
                                        prefix_of=[1] * n, prefix_lens=[], num_q_heads=32, num_kv_heads=8,
                                        head_dim=128, dtype=dtype, device="cuda")
    capped = paged_config(4, 128, q.device, q.element_size(), meta.max_context_len)
    assert capped.get("maxnreg") == 128, capped
    uncapped = {k: v for k, v in capped.items() if k != "maxnreg"}
    outs = []
    for cfg in (capped, uncapped):
        out = torch.full((1,) + tuple(q.shape), float("nan"), dtype=dtype, device="cuda")
        lse = torch.full((1,) + tuple(q.shape[:2]), float("nan"), device="cuda")
        paged_attention(q, kc, vc, meta, 128 ** -0.5, out=out, lse=lse, config=cfg)
        outs.append((out, lse))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    want, _ = ref.context_attention(q.double(), kc.double(), vc.double(), meta, 128 ** -0.5)
    assert rel_err(outs[0][0][0], want) < TOL[dtype]


def test_ws_register_caps_split_what_the_launch_claims():
    """The warp-specialised program's consumers get what 12 warps at the cap hold, less the
    producer warpgroup's 24, in steps of 8; the default cap fills the register file."""
    from relaycli.kernels.gluon_system_attention import WS_REGS, ws_consumer_regs
    assert 12 * WS_REGS * 32 <= 64 * 1024 < 12 * (WS_REGS + 8) * 32 and ws_consumer_regs(WS_REGS) == 240
    for cap in range(48, 256, 8):
        regs = ws_consumer_regs(cap)
        assert regs % 8 == 0 and 8 * regs + 4 * 24 <= 12 * cap, cap
        assert regs == 240 or 8 * (regs + 8) + 4 * 24 > 12 * cap, cap  # the most that fits
    assert ws_consumer_regs(128) == 176
    with pytest.raises(AssertionError):
        ws_consumer_regs(300)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_system_attention_large(dtype):
    q = torch.randn(256, 32, 128, device="cuda").to(dtype)
    k, v = (torch.randn(4099, 8, 128, device="cuda").to(dtype) for _ in range(2))
    o, lse = system_attention(q, k, v, 128 ** -0.5)
    want_o, want_lse = ref.system_attention(q.float(), k.float(), v.float(), 128 ** -0.5)
    assert rel_err(o, want_o) < TOL[dtype]
    assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [(64, 64, 3, False, None), (64, 128, 2, False, None), (128, 128, 2, False, None),
                                  (128, 64, 3, True, None), (128, 128, 2, True, None), (128, 64, 3, True, 128)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gluon_system_attention(dtype, tile, head_dim, monkeypatch):
    """The Hopper Gluon kernels (ws: the warp-specialised one, also capped at 128 registers):
    random GQA shapes, ragged and empty chunks, scattered rows, programs whose second
    warpgroup has no rows."""
    import relaycli.kernels.gluon_system_attention as gluon
    from relaycli.kernels.triton_system_attention import gluon_usable, merge_partials, system_attention_into
    probe = torch.empty(1, 1, head_dim, device="cuda", dtype=dtype)
    if not gluon_usable(probe, probe, probe):
        pytest.skip("the Gluon kernel needs sm_90 and the Triton versions it was tested with")
    calls = []
    real = gluon.gluon_system_attention_into
    monkeypatch.setattr(gluon, "gluon_system_attention_into", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = random.Random()
    block_m, block_n, stages, ws, ws_regs = tile
    for _ in range(4):
        hkv, group = rng.choice([1, 2, 8]), rng.choice([1, 3, 4])
        n, s = rng.randint(1, 300), rng.choice([1, 63, 64, 65, rng.randint(2, 5000)])
        splits = rng.choice([1, 3, 8, 64])
        q = torch.randn(n, hkv * group, head_dim, device="cuda").to(dtype)
        k, v = (torch.randn(s, hkv, head_dim, device="cuda").to(dtype) for _ in range(2))
        rows = torch.tensor(sorted(rng.sample(range(n), rng.randint(1, n))), device="cuda")
        o_part = torch.full((splits, n, hkv * group, head_dim), float("nan"), device="cuda")
        lse_part = torch.full((splits, n, hkv * group), float("nan"), device="cuda")
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if ws else block_m // 16, num_stages=stages,
                   gluon=True, ws=ws, **({} if ws_regs is None else dict(ws_regs=ws_regs)))
        system_attention_into(q, k, v, head_dim ** -0.5, o_part, lse_part, rows, splits, cfg)
        assert calls, "the call did not take the Gluon kernel"
        calls.clear()
        o, lse = merge_partials(o_part[:, rows], lse_part[:, rows], dtype)
        want_o, want_lse = ref.system_attention(q[rows].float(), k.float(), v.float(), head_dim ** -0.5)
        assert rel_err(o, want_o) < TOL[dtype], (hkv, group, n, s, splits)
        assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)
        others = torch.ones(n, dtype=torch.bool, device="cuda")
        others[rows] = False
        assert torch.isnan(o_part[:, others]).all(), "rows outside the group were written"


@gpu
@pytest.mark.gpu
def test_gpu_captured_system_attention_takes_the_gluon_kernel(monkeypatch):
    """The default decode config: an eager step runs Triton, a CUDA graph's step (its eager
    pass and its capture) the Gluon kernel (on Hopper), and both match the reference."""
    import relaycli.kernels.gluon_system_attention as gsa
    from relaycli.kernels.triton_system_attention import gluon_usable, merge_partials, system_attention_into
    q = torch.randn(96, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if not gluon_usable(q, k, v):
        pytest.skip("the Gluon kernel needs sm_90 and the Triton versions it was tested with")
    calls = []
    real = gsa.gluon_system_attention_into
    monkeypatch.setattr(gsa, "gluon_system_attention_into", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    want_o, want_lse = ref.system_attention(q.float(), k.float(), v.float(), 128 ** -0.5)
    o_part = torch.empty(4, 96, 32, 128, device="cuda")
    lse_part = torch.empty(4, 96, 32, device="cuda")
    system_attention_into(q, k, v, 128 ** -0.5, o_part, lse_part, None, 4)
    assert not calls, "an eager call took the Gluon kernel"
    eager = merge_partials(o_part, lse_part, q.dtype)[0]
    o_part.zero_()
    system_attention_into(q, k, v, 128 ** -0.5, o_part, lse_part, None, 4, graphed=True)
    assert calls, "a graph's eager pass did not take the Gluon kernel"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        system_attention_into(q, k, v, 128 ** -0.5, o_part, lse_part, None, 4, graphed=True)
    o_part.zero_()
    graph.replay()
    assert calls, "the captured call did not take the Gluon kernel"
    o, lse = merge_partials(o_part, lse_part, q.dtype)
    for got in (eager, o):
        assert rel_err(got, want_o) < TOL[torch.bfloat16]
    assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)


def test_decode_tiles_read_block_ids_ahead_only_on_grids_that_leave_the_chip_idle():
    from relaycli.kernels.triton_context_attention import paged_config
    from relaycli.kernels.triton_plan import num_sms
    dev = torch.device("cpu")
    slots = 2 * num_sms(dev)
    for keys, per_sm in ((128, 4), (4096, 3)):  # the 32-key tile; the 64-key one, larger with read-ahead
        small = paged_config(4, 64, dev, 2, keys, num_programs=slots)
        assert small["bt_ahead"] and small["num_stages"] == 3 and small["per_sm"] == per_sm, small
        for full in (paged_config(4, 64, dev, 2, keys, num_programs=slots + 1), paged_config(4, 64, dev, 2, keys)):
            assert not full.get("bt_ahead") and full["num_stages"] == 2 and full["per_sm"] == 4, full
    assert not paged_config(32, 64, dev, 2, 4096, num_programs=1).get("bt_ahead")  # prefill rows: unchanged


def test_short_decode_tile_carries_a_register_cap_on_cuda_only():
    """The full-grid 32-key decode tile is capped at 128 registers on CUDA (eight programs an
    SM instead of six); the interpreter, longer key ranges and prefill rows get no cap."""
    from relaycli.kernels.triton_context_attention import MAX_REGISTERS_SHORT_TILE, paged_config
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # paged_config only reads the device type here
    short = paged_config(4, 128, cuda, 2, 300)
    assert short["BLOCK_N"] == 32 and short["maxnreg"] == MAX_REGISTERS_SHORT_TILE == 128, short
    assert "maxnreg" not in paged_config(4, 128, cpu, 2, 300)
    assert "maxnreg" not in paged_config(4, 128, cuda, 2, 4096)
    assert "maxnreg" not in paged_config(64, 128, cuda, 2, 300)


def test_relay_context_launches_plan_read_ahead_from_their_grid_and_the_baseline_does_not(monkeypatch):
    """Relay's context step asks for read-ahead tiles: paged_attention and context_splits
    both pass its grid (sequences x KV heads) to paged_config, so the split plan and the
    launch agree; the baseline's launches pass None and keep the tiles they were timed
    with."""
    from relaycli.kernels import triton_context_attention as tca
    seen = []
    real = tca.paged_config

    def recording(*args, **kwargs):
        seen.append(args[5] if len(args) > 5 else kwargs.get("num_programs"))
        return real(*args, **kwargs)
    monkeypatch.setattr(tca, "paged_config", recording)
    q, kc, vc, prefixes, meta = random_problem(q_lens=[1, 1, 1], ctx_lens=[5, 40, 17], prefix_of=[0, 0, 1],
                                               prefix_lens=[24], num_q_heads=4, num_kv_heads=2, head_dim=16,
                                               device=DEVICE)
    relay_attention(q, kc, vc, meta, prefixes, 0.25)
    assert seen and all(n == 3 * 2 for n in seen), seen
    seen.clear()
    baseline_with(q, kc, vc, meta, prefixes, 0.25)
    assert seen and all(n is None for n in seen), seen


def test_backend_gives_every_relay_call_its_one_side_stream(monkeypatch):
    """The engine's attention backend owns the overlap's second stream and passes it to each
    relay call (no module-level cache); the baseline takes none."""
    import types
    from relaycli.kernels import backend, triton_ops
    calls = []
    monkeypatch.setattr(triton_ops, "relay_attention", lambda *a, **k: calls.append(("relay", k)) or a[0])
    monkeypatch.setattr(triton_ops, "prefix_paged_attention", lambda *a, **k: calls.append(("base", k)) or a[0])
    monkeypatch.setattr(triton_ops, "write_kv", lambda *a: None)
    caches = [torch.zeros(2, 16, 1, 16)]
    meta = types.SimpleNamespace(slot_mapping=None)
    relay = backend.PagedAttention(caches, caches, [], "relay", "triton", 0.25)
    assert relay.side_stream is None  # CPU caches: no stream
    relay.side_stream = stream = object()
    x = torch.zeros(1, 1, 16)
    for _ in range(2):
        relay.attend_fn(meta)(0, x, x, x)
    backend.PagedAttention(caches, caches, [], "no-relay", "triton", 0.25).attend_fn(meta)(0, x, x, x)
    assert [c[0] for c in calls] == ["relay", "relay", "base"]
    assert all(k["side_stream"] is stream for _, k in calls[:2]) and "side_stream" not in calls[2][1]


def test_merge_unroll_keeps_loads_in_flight_only_for_grids_that_leave_the_chip_idle():
    from relaycli.kernels.triton_plan import merge_unroll, num_sms
    dev = torch.device("cpu")
    slots = 2 * num_sms(dev)
    assert merge_unroll(1, dev) == 4 and merge_unroll(slots, dev) == 4
    assert merge_unroll(slots + 1, dev) == 1 and merge_unroll(100 * slots, dev) == 1


def test_merge_block_h_splits_heads_only_while_the_grid_is_small(monkeypatch):
    import relaycli.kernels.triton_plan as plan
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)  # an H200's
    dev = torch.device("cpu")
    # llama3-8b's 32 heads of 128: a row's 32 heads are 4,096 values, so 16 at most a program;
    # fewer until the grid has 3 programs an SM (396), never fewer than 2
    assert [plan.merge_block_h(n, 32, 128, dev) for n in (1, 16, 32, 64, 128, 256, 4096)] == [2, 2, 2, 4, 8, 16, 16]
    assert plan.merge_block_h(256, 32, 64, dev) == 16 and plan.merge_block_h(64, 32, 64, dev) == 4
    assert plan.merge_block_h(512, 9, 64, dev) == 16 and plan.merge_block_h(8, 1, 128, dev) == 1
    # the block of a large grid, all of a row's heads up to 2,048 values, whatever the rows
    assert [plan.merge_row_block_h(h, d) for h, d in ((32, 128), (9, 64), (1, 128), (64, 16))] == [16, 16, 1, 64]


def test_split_plan_picks_powers_of_two_and_leaves_full_batches_whole():
    from relaycli.kernels.triton_plan import split_plan
    dev = torch.device("cpu")  # num_sms: 2 without CUDA, so 16 slots at per_sm=8
    seen = set()
    for programs in range(1, 17):
        for keys in (1, 100, 256, 1000, 5000, 20000):
            splits, per = split_plan(keys, programs, dev, 64, per_sm=8)
            assert splits & (splits - 1) == 0, (programs, keys, splits)
            assert per % 64 == 0 and splits * per >= keys
            seen.add(splits)
    assert len(seen) > 3  # small batches over long prefixes really split
    assert split_plan(20000, 64, dev, 64) == (1, 20032)  # programs fill every slot: no split
    assert split_plan(1000, 1, dev, 64, num_splits=3)[0] == 3  # a forced count is kept


def test_overlapped_step_keeps_the_64_row_tile_where_the_system_kernel_runs_beside_the_context(monkeypatch):
    """plan_system: an unforced warp-specialised tile (which holds a whole SM) gives way to
    DECODE_TILE where the system kernel fits beside the context; where the system step
    is the longer one it stays, planned for its own grid; a forced tile is kept."""
    from relaycli.kernels import triton_ops, triton_plan
    from relaycli.kernels.triton_plan import DECODE_TILE, WS_TILE
    monkeypatch.setattr(triton_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_ops, "system_config", lambda *args: dict(WS_TILE))

    def plan(batch, system, context, config=None):
        work = triton_ops.overlap_work([(batch, system)], batch * context, 32, 8, 128, 2)
        return triton_ops.plan_system([(batch, system)], 32, 8, 128, 2, torch.device("cpu"), config, None, None,
                                      work)

    assert plan(256, 2048, 1024) == (1, DECODE_TILE)  # llama3-8b heads, a full batch of a 2,048-token job
    splits, tile = plan(256, 8192, 128)  # the system step is the longer: 64 programs of 128 rows, 2 splits
    assert tile == WS_TILE and splits == 2
    assert plan(256, 2048, 1024, dict(WS_TILE))[1] == WS_TILE  # forced


def test_warp_specialised_system_tile_is_chosen_by_its_grid_on_hopper_only(monkeypatch):
    """ws_pays: the unsplit grid of 128-row programs covers a quarter of the SMs; the tile
    goes only to sm_90 (Gluon), and never to the interpreter or prefill-sized problems."""
    from relaycli.kernels import triton_plan
    from relaycli.kernels.triton_plan import DECODE_TILE, PREFILL_ROWS, WS_TILE, system_config, ws_pays
    # H200, 132 SMs: batch 256 (64 programs, llama2-7b and llama3-8b heads) takes it,
    # batch 64 (16 and 32 programs) does not
    assert ws_pays(256 * 4, 8, 132) and ws_pays(256, 32, 132)
    assert not ws_pays(64 * 4, 8, 132) and not ws_pays(64, 32, 132)
    assert ws_pays(33 * 128, 1, 132) and not ws_pays(32 * 128, 1, 132)  # 33 of 132 programs: a quarter
    assert system_config(1024, 128, torch.device("cpu"), 2, 8).get("ws") is None
    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_plan, "smem_per_block", lambda device: 224 * 1024)
    for capability, wanted in (((9, 0), WS_TILE), ((8, 0), DECODE_TILE), ((10, 0), DECODE_TILE)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert system_config(1024, 128, cuda, 2, 8) == wanted, capability
        assert system_config(256, 128, cuda, 2, 8) == DECODE_TILE  # batch 64
        assert system_config(PREFILL_ROWS, 128, cuda, 2, 8)["num_warps"] == 8  # the prefill tile


def test_overlapped_step_plans_the_system_kernel_at_one_program_an_sm_where_the_context_is_larger(monkeypatch):
    from relaycli.kernels import triton_plan
    from relaycli.kernels.triton_ops import overlap_work, plan_system
    monkeypatch.setattr(triton_plan, "num_sms", lambda device: 132)  # an H200
    tile = dict(BLOCK_M=64, BLOCK_N=64, per_sm=2)  # the decode tile: two programs an SM

    def planner(batch, system, context, hq, hkv):
        sizes = [(batch, system)]
        work = overlap_work(sizes, batch * context, hq, hkv, 128, 2)
        plan = lambda resident, splits=None: plan_system(sizes, hq, hkv, 128, 2,  # noqa: E731
                                                         torch.device("cpu"), tile, splits, resident, work)[0]
        # the overlapped step puts the system kernel first only where it is matrix-bound
        plan.first = triton_plan.matrix_bound(*work[:2])
        return plan

    # llama3-8b heads, a full batch at 2,048 prefix tokens in a 1,024-key context bucket:
    # 128 programs of one split take one slot an SM; two an SM would take 2 splits
    plan = planner(256, 2048, 1024, 32, 8)
    assert plan(None) == plan(True) == 1 and plan(False) == 2
    # batch 64: 32 programs are enough to finish under the context step (two an SM: 4 splits)
    plan = planner(64, 2048, 1024, 32, 8)
    assert plan(None) == 1 and plan(False) == 4
    # 8,192 prefix tokens, 128 own: the system step is the larger one and keeps its plan
    plan = planner(256, 8192, 128, 32, 8)
    assert plan(None) == plan(False) == 2 and plan(True) == 1
    plan = planner(64, 8192, 128, 32, 8)
    assert plan(None) == plan(False) == 8 and plan.first
    # llama2-7b heads at batch 64: a byte-bound system step would share the bandwidth, not hide
    plan = planner(64, 8192, 128, 32, 32)
    assert plan(None) == plan(False) and not plan.first  # and the context kernel goes first
    # at batch 256 it is matrix-bound and the context (537 MB) the larger step
    assert planner(256, 8192, 128, 32, 32)(None) == 1 and planner(256, 8192, 128, 32, 32).first
    assert plan(None, splits=3) == 3  # a forced count wins

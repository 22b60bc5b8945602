"""The pure-PyTorch relay and baseline attention equal textbook attention over S ∪ C."""

import math
import random

import pytest
import torch

from relaycli.kernels.reference import (attention_lse, merge_attention, prefix_paged_attention,
                               relay_attention, system_attention)
from tests.helpers_attention import expected_output, random_problem


def _shapes(rng: random.Random, decode: bool):
    num_kv = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 3, 4])
    num_seqs = rng.choice([1, 3, 17, 64])
    ctx = [rng.randint(1, 512) for _ in range(num_seqs)]
    q = [1 if decode else rng.randint(1, c) for c in ctx]
    prefix_lens = [rng.choice([1, 7, 300, 4096]), rng.randint(1, 200)]
    prefix_of = [rng.choice([0, 0, 1, 2]) for _ in range(num_seqs)]  # 2 = no prefix
    return dict(q_lens=q, ctx_lens=ctx, prefix_of=prefix_of, prefix_lens=prefix_lens,
                num_q_heads=num_kv * group, num_kv_heads=num_kv, head_dim=rng.choice([16, 64]))


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("trial", range(4))
def test_relay_and_baseline_equal_concatenated_attention(decode, trial):
    rng = random.Random()
    shapes = _shapes(rng, decode)
    q, kc, vc, prefixes, meta = random_problem(**shapes)
    scale = 1 / math.sqrt(shapes["head_dim"])
    want = expected_output(q, kc, vc, prefixes, meta, shapes["prefix_of"], scale)
    got_relay = relay_attention(q, kc, vc, meta, prefixes, scale)
    got_base = prefix_paged_attention(q, kc, vc, meta, prefixes, scale)
    assert (got_relay.double() - want).abs().max().item() < 1e-5, shapes
    assert (got_base.double() - want).abs().max().item() < 1e-5, shapes


def test_merge_is_exact_split_of_softmax():
    q = torch.randn(5, 1, 8, 32)
    k = torch.randn(5, 70, 2, 32)
    v = torch.randn(5, 70, 2, 32)
    full, lse_full = attention_lse(q, k, v, 0.2)
    o_a, lse_a = attention_lse(q, k[:, :30], v[:, :30], 0.2)
    o_b, lse_b = attention_lse(q, k[:, 30:], v[:, 30:], 0.2)
    assert torch.allclose(merge_attention(o_a, lse_a, o_b, lse_b), full, atol=1e-6)
    assert torch.allclose(torch.logaddexp(lse_a, lse_b), lse_full, atol=1e-5)


def test_empty_side_leaves_other_unchanged():
    o = torch.randn(4, 3, 16)
    lse = torch.randn(4, 3)
    empty_o, empty_lse = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
    assert torch.equal(merge_attention(empty_o, empty_lse, o, lse), o)
    assert torch.equal(merge_attention(o, lse, empty_o, empty_lse), o)


def test_system_attention_stacks_all_queries():
    q = torch.randn(9, 6, 16)
    k, v = torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    o, lse = system_attention(q, k, v, 0.25)
    for n in range(9):
        on, ln = attention_lse(q[n:n + 1, None], k[None], v[None], 0.25)
        assert torch.allclose(o[n], on[0, 0], atol=1e-6)
        assert torch.allclose(lse[n], ln[0, 0], atol=1e-6)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_flash_path_equals_reference(decode, dtype):
    from relaycli.kernels import cpu_flash
    if not cpu_flash.is_available():
        pytest.skip("this torch has no fused CPU flash attention")
    rng = random.Random()
    shapes = _shapes(rng, decode)
    q, kc, vc, prefixes, meta = random_problem(**shapes, dtype=dtype)
    scale = 1 / math.sqrt(shapes["head_dim"])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name in ("relay_attention", "prefix_paged_attention"):
        want = getattr(__import__("relaycli.kernels.reference", fromlist=[name]), name)(q, kc, vc, meta, prefixes, scale)
        got = getattr(cpu_flash, name)(q, kc, vc, meta, prefixes, scale)
        assert (got.float() - want.float()).abs().max().item() < tol * max(1.0, want.float().abs().max().item()), name
    expect = expected_output(q.float(), kc.float(), vc.float(), [(k.float(), v.float()) for k, v in prefixes], meta,
                             shapes["prefix_of"], scale)
    got = cpu_flash.relay_attention(q, kc, vc, meta, prefixes, scale)
    assert (got.double() - expect).abs().max().item() < (1e-5 if dtype == torch.float32 else 3e-2)


def test_fused_lse_marks_rows_without_keys():
    from relaycli.kernels import cpu_flash
    if not cpu_flash.is_available():
        pytest.skip("this torch has no fused CPU flash attention")
    q, k, v = torch.randn(2, 5, 4, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
    mask = torch.rand(2, 5, 7) > 0.4
    mask[1, 3] = False
    o, lse = cpu_flash.fused_attention_lse(q, k, v, 0.25, mask)
    o_ref, lse_ref = attention_lse(q, k, v, 0.25, mask)
    assert torch.isneginf(lse[1, 3]).all() and torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    finite = ~torch.isneginf(lse_ref)
    assert torch.allclose(lse[finite], lse_ref[finite], atol=1e-5)
    assert torch.allclose(o, o_ref, atol=1e-5)

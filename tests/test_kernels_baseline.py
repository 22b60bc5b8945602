"""The --no-relay baseline in Triton (kernels/triton_paged_decode.py: one softmax over prefix +
own keys a request, split or not) against kernels/reference.py and float64 textbook
attention. Inputs are fresh random draws on every run."""

import random

import pytest
import torch

from tests.helpers_kernels import TOL, baseline_with, interpret_on_cpu, make, rel_err, shapes, textbook, upcast

interpret_on_cpu()

from relaycli.kernels import reference as ref  # noqa: E402
from relaycli.kernels.tiles import Tile  # noqa: E402
from relaycli.kernels.triton_ops import prefix_paged_attention  # noqa: E402

SMALL_CTX = Tile(16, 16, 4, 2)  # many tiles, so splits really cut


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("splits", [None, 3])
def test_prefix_paged_attention(dtype, decode, splits):
    shape = shapes(random.Random(), decode)
    q, kc, vc, prefixes, meta, scale = make(shape, dtype)
    if splits is None:
        got = prefix_paged_attention(q, kc, vc, meta, prefixes, scale)
    else:
        got = baseline_with(q, kc, vc, meta, prefixes, scale, splits, SMALL_CTX)
    qf, kf, vf, pf = upcast(q, kc, vc, prefixes)
    assert rel_err(got, ref.prefix_paged_attention(qf, kf, vf, meta, pf, scale)) < TOL[dtype]
    assert rel_err(got, textbook(shape, q, kc, vc, prefixes, meta, scale)) < TOL[dtype]


def test_baseline_rejects_bad_inputs():
    gqa = dict(shapes(random.Random(), decode=True), num_q_heads=4, num_kv_heads=2)
    q, kc, vc, _, meta, scale = make(gqa, torch.float32)
    with pytest.raises(AssertionError, match="not a multiple"):
        prefix_paged_attention(q[:, :3].contiguous(), kc, vc, meta, [], scale)

"""Every plan kind of kernels/planner.py, run by its executor, against kernels/reference.py:
under TRITON_INTERPRET=1 on the CPU (small fp32/fp16 shapes) where the kind runs there; the
GPU-only kinds (relay-fused: Gluon, sm_90) are marked gpu and skip elsewhere."""

import dataclasses
import random

import pytest
import torch

from tests.helpers_attention import random_problem
from tests.helpers_kernels import (DEVICE, TOL, gpu, interpret_on_cpu, make, rel_err, relay_plan,
                                   relay_reference, shapes, upcast)

interpret_on_cpu()

from relaycli.kernels import planner  # noqa: E402
from relaycli.kernels import reference as ref  # noqa: E402
from relaycli.kernels.triton_ops import execute  # noqa: E402
from relaycli.kernels.triton_paged_decode import group_prefixes, run_baseline  # noqa: E402
from relaycli.kernels.triton_system_attention import run_system  # noqa: E402

GPU_ONLY = {planner.RELAY_FUSED}
KINDS = [pytest.param(k, marks=[gpu, pytest.mark.gpu]) if k in GPU_ONLY else k for k in planner.KINDS]


def fused_step(dtype):
    """A CUDA graph's decode step the planner gives the fused kernel on sm_90: llama3-8b
    heads, 64 rows behind a 2,048-token prefix, 64-key cache blocks."""
    rng = random.Random()
    lens = [rng.randint(1, 120) for _ in range(64)]
    q, kc, vc, prefixes, meta = random_problem(q_lens=[1] * 64, ctx_lens=lens, prefix_of=[0] * 64,
                                               prefix_lens=[2048], num_q_heads=32, num_kv_heads=8, head_dim=128,
                                               block_size=64, dtype=dtype, device=DEVICE)
    return q, kc, vc, prefixes, dataclasses.replace(meta, graphed=True, _cache={}), 128 ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_every_plan_kind_computes_the_reference(kind, dtype):
    rng = random.Random()
    if kind == planner.RELAY_FUSED:
        dtype = torch.bfloat16 if dtype == torch.float32 else dtype  # the fused kernel is 16-bit
        q, kc, vc, prefixes, meta, scale = fused_step(dtype)
        plan = relay_plan(q, kc, vc, meta, prefixes)
        if plan.kind != kind:
            pytest.skip("the fused kernel needs sm_90 and Gluon")
        got, want = execute(plan, q, kc, vc, meta, prefixes, scale), relay_reference(q, kc, vc, prefixes, meta, scale)
        assert rel_err(got, want) < TOL[torch.bfloat16]
        return
    shape = shapes(rng, decode=rng.random() < 0.5)
    if kind == planner.CONTEXT:
        shape["prefix_of"] = [len(shape["prefix_lens"])] * len(shape["q_lens"])  # no prefix: the context alone
    q, kc, vc, prefixes, meta, scale = make(shape, dtype)
    merge = planner.merge_tile(q.shape[0], q.shape[1], q.shape[2], q.device)
    if kind == planner.SYSTEM:
        k_sys, v_sys = prefixes[0]
        plan = dataclasses.replace(planner.plan_system(q, k_sys), sys_splits=rng.choice([1, 2, 3]), merge=merge)
        o, lse = run_system(plan, q, k_sys, v_sys, scale)
        want_o, want_lse = ref.system_attention(*upcast(q, k_sys, v_sys, [])[:3], scale)
        assert rel_err(o, want_o) < TOL[dtype] and torch.allclose(lse, want_lse, atol=1e-4, rtol=1e-5)
        return
    if kind == planner.BASELINE:
        plan = planner.plan_baseline(q, kc, meta, group_prefixes(meta, prefixes))
        plan = dataclasses.replace(plan, ctx_splits=rng.choice([1, 2, 3]), merge=merge)
        qf, kf, vf, pf = upcast(q, kc, vc, prefixes)
        want = ref.prefix_paged_attention(qf, kf, vf, meta, pf, scale)
        assert rel_err(run_baseline(plan, q, kc, vc, meta, prefixes, scale), want) < TOL[dtype]
        return
    plan = relay_plan(q, kc, vc, meta, prefixes)
    ctx_splits = 1 if kind in (planner.RELAY_EPILOGUE, planner.CONTEXT) else rng.choice([1, 2, 3])
    plan = dataclasses.replace(plan, kind=kind, ctx_splits=ctx_splits, merge=merge)
    got = execute(plan, q, kc, vc, meta, prefixes, scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert rel_err(got, relay_reference(q, kc, vc, prefixes, meta, scale)) < TOL[dtype]

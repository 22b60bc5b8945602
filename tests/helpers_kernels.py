"""What the attention kernel test files share: the interpreter on CPU, random step shapes,
tolerances and float64 textbook attention.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small fp32/fp16 shapes (the
interpreter gets bf16 tl.dot wrong); with CUDA, larger shapes in bf16/fp16/fp32 too.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import random
import sys

import pytest
import torch

from tests.helpers_attention import expected_output, random_problem

KERNEL_MODULES = ["relaycli.kernels.triton_system_attention", "relaycli.kernels.triton_merge",
                  "relaycli.kernels.triton_context_attention",
                  "relaycli.kernels.triton_grouped_system", "relaycli.kernels.triton_paged_decode",
                  "relaycli.kernels.triton_ops"]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}  # relative L2 error


def interpret_on_cpu() -> None:
    """Without CUDA, run the kernels under Triton's interpreter: set TRITON_INTERPRET and
    re-import the kernel modules someone loaded earlier (@triton.jit picks interpreter or
    compiler at import). Call it before importing them, at the top of a test file."""
    if not CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    for name in KERNEL_MODULES:
        if name in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
            importlib.reload(sys.modules[name])


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


def relay_reference(q, kc, vc, prefixes, meta, scale) -> torch.Tensor:
    """kernels/reference.py's relay attention in fp32."""
    from relaycli.kernels import reference as ref
    qf, kf, vf, pf = upcast(q, kc, vc, prefixes)
    return ref.relay_attention(qf, kf, vf, meta, pf, scale)


def relay_plan(q, kc, vc, meta, prefixes):
    """The planner's plan of relay_attention for this step (what a test then varies)."""
    from relaycli.kernels import planner
    from relaycli.kernels.triton_paged_decode import group_prefixes
    return planner.plan_relay(q, kc, vc, meta, group_prefixes(meta, prefixes))


def baseline_with(q, kc, vc, meta, prefixes, scale, splits=None, tile=None):
    """The --no-relay baseline with its split count and its launches' tile forced (None: the
    planner's); each launch keeps the planner's order of programs (heads_fast)."""
    from relaycli.kernels import planner
    from relaycli.kernels.triton_paged_decode import group_prefixes, run_baseline
    groups = group_prefixes(meta, prefixes) if meta.prefix_table is None else []
    plan = planner.plan_baseline(q, kc, meta, groups)
    if splits is not None:
        merge = planner.merge_tile(q.shape[0], q.shape[1], q.shape[2], q.device) if splits > 1 else None
        plan = dataclasses.replace(plan, ctx_splits=splits, merge=merge)
    if tile is not None:
        plan = dataclasses.replace(plan, ctx_tiles=tuple(tile.replace(heads_fast=t.heads_fast) for t in plan.ctx_tiles))
    return run_baseline(plan, q, kc, vc, meta, prefixes, scale)

"""The system kernels (all queries of a batch against one shared prefix, split-K partials)
against kernels/reference.py and float64 textbook attention: kernels/triton_system_attention.py,
and on sm_90 kernels/gluon_system_attention.py. Inputs are fresh random draws on every run."""

import dataclasses
import random

import pytest
import torch

from tests.helpers_kernels import DEVICE, TOL, gpu, interpret_on_cpu, rel_err

interpret_on_cpu()

from relaycli.kernels import planner  # noqa: E402
from relaycli.kernels import reference as ref  # noqa: E402
from relaycli.kernels.tiles import MergeTile, Tile  # noqa: E402
from relaycli.kernels.triton_system_attention import run_system, system_attention  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("tma", [False, True])
def test_system_attention(dtype, splits, tma):
    rng = random.Random()
    hkv, group, d = rng.choice([1, 2]), rng.choice([1, 3, 4]), rng.choice([16, 32])
    n, s = rng.randint(1, 40), rng.randint(1, 300)
    q = torch.randn(n, hkv * group, d, device=DEVICE).to(dtype)
    k, v = (torch.randn(s, hkv, d, device=DEVICE).to(dtype) for _ in range(2))
    plan = planner.plan_system(q, k)
    if splits is not None:  # forced splits (one or more of them empty where s is short)
        plan = dataclasses.replace(plan, sys_splits=splits, merge=planner.merge_tile(n, hkv * group, d, q.device))
    if tma:  # small tiles read by tensor descriptors (the interpreter emulates them)
        plan = dataclasses.replace(plan, sys_tile=Tile(16, 16, 4, 2, tma=True))
    o, lse = run_system(plan, q, k, v, 0.2)
    want_o, want_lse = ref.system_attention(q.float(), k.float(), v.float(), 0.2)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(o, want_o) < TOL[dtype]
    assert torch.allclose(lse, want_lse, atol=1e-4, rtol=1e-5)
    row = rng.randrange(n)
    naive = ref.naive_attention(q[row:row + 1].cpu(), k.cpu(), v.cpu(), 0.2, s)
    assert rel_err(o[row:row + 1].cpu(), naive) < TOL[dtype]


def test_system_attention_rejects_bad_inputs():
    q = torch.randn(3, 4, 16, device=DEVICE)
    k = torch.randn(10, 2, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="k_sys"):
        system_attention(q, k[:, :, :8], k, 0.25)


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
@pytest.mark.parametrize("tile", [(64, 64, 3, False), (64, 128, 2, False), (128, 128, 2, False),
                                  (128, 64, 3, True), (128, 128, 2, True)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gluon_system_attention(dtype, tile, head_dim, monkeypatch):
    """The Hopper Gluon kernels (ws: the warp-specialised one): random GQA shapes, ragged and
    empty chunks, scattered rows, programs whose second warpgroup has no rows."""
    import relaycli.kernels.gluon_system_attention as gluon
    from relaycli.kernels.triton_merge import merge_partials
    from relaycli.kernels.triton_system_attention import gluon_usable, system_attention_into
    probe = torch.empty(1, 1, head_dim, device="cuda", dtype=dtype)
    if not gluon_usable(probe, probe, probe):
        pytest.skip("the Gluon kernel needs sm_90 and the Triton versions it was tested with")
    calls = []
    real = gluon.gluon_system_attention_into
    monkeypatch.setattr(gluon, "gluon_system_attention_into", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = random.Random()
    block_m, block_n, stages, ws = tile
    for _ in range(4):
        hkv, group = rng.choice([1, 2, 8]), rng.choice([1, 3, 4])
        n, s = rng.randint(1, 300), rng.choice([1, 63, 64, 65, rng.randint(2, 5000)])
        splits = rng.choice([1, 3, 8, 64])
        q = torch.randn(n, hkv * group, head_dim, device="cuda").to(dtype)
        k, v = (torch.randn(s, hkv, head_dim, device="cuda").to(dtype) for _ in range(2))
        rows = torch.tensor(sorted(rng.sample(range(n), rng.randint(1, n))), device="cuda")
        o_part = torch.full((splits, n, hkv * group, head_dim), float("nan"), device="cuda")
        lse_part = torch.full((splits, n, hkv * group), float("nan"), device="cuda")
        cfg = Tile(block_m, block_n, 4 if ws else block_m // 16, stages, gluon=True, ws=ws)
        system_attention_into(q, k, v, head_dim ** -0.5, o_part, lse_part, rows, cfg)
        assert calls, "the call did not take the Gluon kernel"
        calls.clear()
        o, lse = merge_partials(o_part[:, rows], lse_part[:, rows], dtype, MergeTile(1, 1))
        want_o, want_lse = ref.system_attention(q[rows].float(), k.float(), v.float(), head_dim ** -0.5)
        assert rel_err(o, want_o) < TOL[dtype], (hkv, group, n, s, splits)
        assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)
        others = torch.ones(n, dtype=torch.bool, device="cuda")
        others[rows] = False
        assert torch.isnan(o_part[:, others]).all(), "rows outside the group were written"


@gpu
@pytest.mark.gpu
def test_gpu_captured_system_attention_takes_the_gluon_kernel(monkeypatch):
    """The decode tile as the planner decides it: an eager step's runs Triton, a CUDA graph's
    step's (its eager pass and its capture) the Gluon kernel (on Hopper), and both match the
    reference."""
    import relaycli.kernels.gluon_system_attention as gsa
    from relaycli.kernels.system_plan import resolve
    from relaycli.kernels.tiles import DECODE_TILE
    from relaycli.kernels.triton_merge import merge_partials
    from relaycli.kernels.triton_system_attention import gluon_usable, system_attention_into
    q = torch.randn(96, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if not gluon_usable(q, k, v):
        pytest.skip("the Gluon kernel needs sm_90 and the Triton versions it was tested with")
    calls = []
    real = gsa.gluon_system_attention_into
    monkeypatch.setattr(gsa, "gluon_system_attention_into", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    want_o, want_lse = ref.system_attention(q.float(), k.float(), v.float(), 128 ** -0.5)
    merge = planner.merge_tile(96, 32, 128, q.device)
    o_part = torch.empty(4, 96, 32, 128, device="cuda")
    lse_part = torch.empty(4, 96, 32, device="cuda")
    system_attention_into(q, k, v, 128 ** -0.5, o_part, lse_part, None, resolve(DECODE_TILE, False))
    assert not calls, "an eager call took the Gluon kernel"
    eager = merge_partials(o_part, lse_part, q.dtype, merge)[0]
    o_part.zero_()
    graphed = resolve(DECODE_TILE, True)
    system_attention_into(q, k, v, 128 ** -0.5, o_part, lse_part, None, graphed)
    assert calls, "a graph's eager pass did not take the Gluon kernel"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        system_attention_into(q, k, v, 128 ** -0.5, o_part, lse_part, None, graphed)
    o_part.zero_()
    graph.replay()
    assert calls, "the captured call did not take the Gluon kernel"
    o, lse = merge_partials(o_part, lse_part, q.dtype, merge)
    for got in (eager, o):
        assert rel_err(got, want_o) < TOL[torch.bfloat16]
    assert torch.allclose(lse, want_lse, atol=2e-2, rtol=1e-3)

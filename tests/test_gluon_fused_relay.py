"""kernels/gluon_fused_relay.py (own keys inside the warp-specialised system program) against
kernels/reference.py on fresh random inputs. Hopper only: Gluon has no interpreter, so
these run on a Hopper GPU (scripts/device_check.sh tests) and skip elsewhere."""

import dataclasses
import random

import pytest
import torch

# The CUDA check comes first: without a GPU this module must not import Triton, since the
# interpreter tests need to be the first to (they set TRITON_INTERPRET before Triton loads).
if not torch.cuda.is_available():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)
pytest.importorskip("triton")

from relaycli.kernels import reference as ref  # noqa: E402
from relaycli.kernels import planner  # noqa: E402
from relaycli.kernels.tiles import FUSED_WIDE_TILE, FusedTile, MergeTile  # noqa: E402
from relaycli.kernels.triton_plan import fused_decode_plan, is_sm90  # noqa: E402
from relaycli.bench.kernels import build_step  # noqa: E402
from relaycli.bench.timing import replayed  # noqa: E402

if not is_sm90(torch.device("cuda")):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from relaycli.kernels.gluon_fused_relay import fused_relay_decode  # noqa: E402


def _step(hq, hkv, d, lens, prefix, dtype):
    gen = torch.Generator(device="cuda")
    gen.seed()
    return build_step(hq, hkv, d, len(lens), prefix, 0, torch.device("cuda"), dtype, gen, 64, lens)


def _merge(q, pdl=True) -> MergeTile:
    return planner.merge_tile(q.shape[0], q.shape[1], q.shape[2], q.device, pdl=pdl)


def _check(q, kc, vc, pre, meta, splits, tile=FusedTile(), spill_free=True):
    """fused_relay_decode with this tile against the reference in float64; spill_free: the
    compiled kernel spills at most what the register plan is known to (below)."""
    d = q.shape[-1]
    k_sys, v_sys = pre[0]
    got, kernel = fused_relay_decode(q, k_sys, v_sys, kc, vc, meta.block_tables, meta.context_lens, d ** -0.5,
                                     splits, tile, _merge(q))
    want = ref.relay_attention(q.double(), kc.double(), vc.double(), meta, [(k_sys.double(), v_sys.double())],
                               d ** -0.5)
    assert got.dtype == q.dtype and got.shape == q.shape
    err = ((got.double() - want).norm() / want.norm()).item()
    assert torch.isfinite(got).all() and err < 1e-2, (err, splits, tile)
    # the register plan holds: no partition spills where G >= 2 (llama3-8b's 4 among them); at
    # G = 1 the own-key warpgroup spills one register once in its prologue, and so does it at
    # 56 registers beside 128-key prefix tiles (FUSED_WIDE_TILE; H200, Triton 3.6)
    g = q.shape[1] // k_sys.shape[1]
    if spill_free:
        assert kernel.n_spills <= (0 if g > 1 and not tile.q_smem else 2), (g, kernel.n_spills, tile)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 32, 128), (16, 2, 64), (9, 3, 64), (28, 4, 128)])
def test_fused_relay_ragged_batches(dtype, heads):
    # own lengths at and around a block's edge, batches that end inside a program's 128 rows,
    # a prefix that ends inside a tile, and more splits than a program has requests
    hq, hkv, d = heads
    rng = random.Random()
    for batch, prefix in ((1, 64), (5, 1000), (37, 2048), (256, 4096)):
        lens = [rng.choice([1, 63, 64, 65, 128, rng.randint(1, 400)]) for _ in range(batch)]
        q, kc, vc, pre, meta = _step(hq, hkv, d, lens, prefix, dtype)
        for splits in sorted({1, 2, 8, 32 if prefix >= 2048 else 1}):
            _check(q, kc, vc, pre, meta, splits)
        _check(q, kc, vc, pre, meta, 2, FUSED_WIDE_TILE)  # the engine's tile at 4+ row tiles a KV head


def test_fused_relay_ring_depths_and_register_splits():
    lens = [random.randint(1, 300) for _ in range(64)]
    q, kc, vc, pre, meta = _step(32, 8, 128, lens, 2048, torch.bfloat16)
    for tile in (FusedTile(stages=2), FusedTile(stages=4), FusedTile(ctx_tiles=6), FUSED_WIDE_TILE):
        _check(q, kc, vc, pre, meta, 4, tile)
    # results only, where registers spill: shallower own-key rings (a 2-tile ring spills
    # registers on the H200, and the wide tile with it, by ptxas -v), and another register
    # split (at 120 the own-key warpgroup spills a register)
    for tile in (FusedTile(ctx_tiles=2), FusedTile(ctx_tiles=3), dataclasses.replace(FUSED_WIDE_TILE, ctx_tiles=2),
                 FusedTile(sys_regs=184, ctx_regs=120)):
        _check(q, kc, vc, pre, meta, 4, tile, spill_free=False)


def test_pdl_merge_gives_the_plain_merges_bits():
    # the merge as a programmatic dependent of the fused kernel (the default) waits for it
    # before any load: the same bits as the merge launched after it, eagerly and replayed in
    # a graph, step after step (a merge that read partials early would differ somewhere)
    rng = random.Random()
    for batch, prefix in ((1, 1000), (64, 8192), (256, 8192)):
        lens = [rng.randint(1, 300) for _ in range(batch)]
        q, kc, vc, pre, meta = _step(32, 8, 128, lens, prefix, torch.bfloat16)
        k_sys, v_sys = pre[0]
        args = (q, k_sys, v_sys, kc, vc, meta.block_tables, meta.context_lens, 128 ** -0.5, 8 if batch < 256 else 2,
                FusedTile())
        plain = fused_relay_decode(*args, _merge(q, pdl=False))[0]
        for _ in range(3):
            assert torch.equal(fused_relay_decode(*args, _merge(q))[0], plain), batch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_relay_decode(*args, _merge(q))[0]
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, plain), batch


def test_fused_relay_refuses_what_it_cannot_read():
    q, kc, vc, pre, meta = _step(32, 8, 128, [10, 20], 256, torch.bfloat16)
    k_sys, v_sys = pre[0]
    small = kc.view(-1, 16, *kc.shape[2:])  # 16-key blocks: one TMA a chunk needs 64
    with pytest.raises(AssertionError):
        fused_relay_decode(q, k_sys, v_sys, small, small, meta.block_tables, meta.context_lens, 1.0, 1, FusedTile(),
                           _merge(q))
    q9 = torch.randn(2, 18, 128, device="cuda", dtype=torch.bfloat16)  # 9 query heads a KV head: more than 8
    with pytest.raises(AssertionError):
        fused_relay_decode(q9, k_sys[:, :2].contiguous(), v_sys[:, :2].contiguous(), kc[:, :, :2].contiguous(),
                           vc[:, :, :2].contiguous(), meta.block_tables, meta.context_lens, 1.0, 1, FusedTile(),
                           _merge(q9))
    with pytest.raises(AssertionError, match="registers"):
        fused_relay_decode(q, k_sys, v_sys, kc, vc, meta.block_tables, meta.context_lens, 1.0, 1,
                           FusedTile(sys_regs=200), _merge(q))


def test_graphed_engine_step_runs_the_fused_kernel(monkeypatch):
    # relay's Triton step captured in a CUDA graph takes the fused kernel where the plan says
    # it pays (a graph's padding rows have no own keys: context_lens 0), and the same step
    # run eagerly, or forced to the overlapped plan, takes the other paths: all equal to the reference
    # (G = 4, 2, 1 and 3, SmolLM2's: its requests' rows straddle two programs' 128)
    import relaycli.kernels.gluon_fused_relay as gfr
    from relaycli.kernels import triton_ops
    launches = []

    def counted(*args, **kw):
        launches.append(args[8])
        return fused_relay_decode(*args, **kw)
    monkeypatch.setattr(gfr, "fused_relay_decode", counted)
    rng = random.Random()
    for (hq, hkv, d), batch, prefix, longest in (((32, 8, 128), 256, 8192, 200), ((32, 16, 64), 160, 8192, 100),
                                                 ((32, 32, 128), 64, 8192, 100), ((9, 3, 64), 200, 8192, 100)):
        lens = [rng.randint(1, longest) for _ in range(batch)]
        q, kc, vc, pre, meta = _step(hq, hkv, d, lens, prefix, torch.bfloat16)
        meta = dataclasses.replace(meta, graphed=True, _cache={})  # a CUDA graph's step
        # shapes the plan gives the fused kernel (priced as a graph without a total: rows x longest)
        assert fused_decode_plan(batch, hq, hkv, d, 2, 64, q.device, prefix, batch * max(lens), max(lens))
        k_sys, v_sys = pre[0]
        want = ref.relay_attention(q.double(), kc.double(), vc.double(), meta, [(k_sys.double(), v_sys.double())],
                                   d ** -0.5)
        pads = rng.sample(range(batch), batch // 8)
        meta.context_lens[pads] = 0  # padding rows: their outputs are dropped, only finite
        real = torch.ones(batch, dtype=torch.bool, device=q.device)
        real[pads] = False
        groups = triton_ops.group_prefixes(meta, pre)
        assert planner.plan_relay(q, kc, vc, meta, groups).kind == planner.RELAY_FUSED
        # the plan the step takes where the fused kernel cannot read its tensors
        overlap = planner.plan_relay_shape(planner.step_shape(q, kc, meta, groups), fused_layout=False)
        assert overlap.kind == planner.RELAY_OVERLAP
        for fused in (True, False):
            launches.clear()
            step = (lambda: triton_ops.relay_attention(q, kc, vc, meta, pre, d ** -0.5)) if fused else \
                (lambda: triton_ops.execute(overlap, q, kc, vc, meta, pre, d ** -0.5))
            out = replayed(step)
            # replayed calls the step twice (an eager warm-up, then the capture): each call of a
            # graphed step with the fused plan launches the fused kernel once, the overlapped plan never
            assert len(launches) == (2 if fused else 0), (hq, hkv, batch, fused)
            err = ((out[real].double() - want[real]).norm() / want[real].norm()).item()
            assert torch.isfinite(out).all() and err < 1e-2, (hq, hkv, batch, fused, err)
        eager = triton_ops.relay_attention(q, kc, vc, dataclasses.replace(meta, graphed=False, _cache={}), pre,
                                           d ** -0.5)
        err = ((eager[real].double() - want[real]).norm() / want[real].norm()).item()
        assert err < 1e-2

"""The attention planner (kernels/planner.py, kernels/system_plan.py, kernels/triton_plan.py):
which kind, tiles, splits and row order it picks for representative steps and devices (fake
device properties: an H200's 132 SMs, sm_90 or sm_80), without running a kernel."""

import random

import pytest
import torch

from relaycli.kernels import planner, triton_plan
from relaycli.kernels.planner import AttentionPlan
from relaycli.kernels.system_plan import StepShape, overlap_work, plan_system_step, system_splits
from relaycli.kernels.tiles import DECODE_TILE, FUSED_WIDE_TILE, WS_TILE, FusedTile, Tile
from relaycli.kernels.triton_plan import PREFILL_ROWS, paged_config, split_plan, system_config, ws_pays

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def h200(monkeypatch):
    """A fake CUDA device: 132 SMs, 224 KiB of shared memory a program, compute capability
    set by the returned function (sm_90 until told otherwise)."""
    monkeypatch.setattr(triton_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_plan, "smem_per_block", lambda device: 224 * 1024)
    monkeypatch.setattr(torch.version, "hip", None)

    def capability(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    capability((9, 0))
    return capability


def step(device, rows=256, prefix=8192, own=128, heads=(32, 8, 128), graphed=True, block=64, table=None,
         decode=True, elem=2, longest=None):
    """A decode step (or a prefill one, decode=False: rows queries of one sequence) of
    `rows` rows behind one prefix (None: no prefix), `own` own keys a row."""
    hq, hkv, d = heads
    seqs = rows if decode else 1
    return StepShape(num_rows=rows, num_seqs=seqs, is_decode=decode, max_seqlen_q=1 if decode else rows,
                     max_context_len=longest or (own if decode else rows + own), context_tokens=seqs * own,
                     num_heads=hq, num_kv_heads=hkv, head_dim=d, elem=elem, block_size=block,
                     groups=((rows, prefix),) if prefix else (), table_keys=table, graphed=graphed, device=device)


def test_the_planner_picks_each_kind_by_its_rule(h200):
    # sm_90, a CUDA graph's full decode batch under a long prompt: the fused own-key kernel,
    # with the wide tile at 4+ row tiles a KV head and the merge a programmatic dependent
    fused = planner.plan_relay_shape(step(CUDA))
    assert fused.kind == planner.RELAY_FUSED and fused.sys_splits == 2 and fused.fused == FUSED_WIDE_TILE
    assert fused.merge.pdl
    assert planner.plan_relay_shape(step(CUDA, rows=64)).fused == FusedTile()
    # where the fused kernel cannot run or does not pay: the overlapped step
    for other in (step(CUDA, block=16), step(CUDA, elem=4), step(CUDA, prefix=64), step(CUDA, longest=16384)):
        assert planner.plan_relay_shape(other).kind == planner.RELAY_OVERLAP, other
    assert planner.plan_relay_shape(step(CUDA), fused_layout=False).kind == planner.RELAY_OVERLAP
    h200((8, 0))  # sm_80: no Gluon kernels, no fused step
    overlap = planner.plan_relay_shape(step(CUDA))
    assert overlap.kind == planner.RELAY_OVERLAP and overlap.sys_tile.tma and overlap.sys_tile.gluon
    assert overlap.merge is not None and overlap.ctx_splits >= 1
    h200((9, 0))
    # eager steps (not a graph's): the context kernel's epilogue merges, tma and gluon off
    eager = planner.plan_relay_shape(step(CUDA, graphed=False))
    assert eager.kind == planner.RELAY_EPILOGUE and not eager.sys_tile.tma and not eager.sys_tile.gluon
    # few sequences, long own contexts: the context splits and the merge kernel finishes
    assert planner.plan_relay_shape(step(CUDA, rows=1, own=30000, graphed=False)).kind == planner.RELAY_MERGE
    # a prefill step: the prefill tile, eagerly
    prefill = planner.plan_relay_shape(step(CUDA, rows=PREFILL_ROWS // 4, decode=False, graphed=False))
    assert prefill.kind == planner.RELAY_EPILOGUE and prefill.sys_tile.num_warps == 8
    # no prefix: the context kernel alone
    assert planner.plan_relay_shape(step(CUDA, prefix=None)).kind == planner.CONTEXT
    assert planner.plan_relay_shape(step(CPU, prefix=None, graphed=False)).kind == planner.CONTEXT
    # rows of several prefixes in a PrefixTable: the grouped kernel, overlapped in a graph
    table = planner.plan_relay_shape(step(CUDA, prefix=None, table=8192))
    assert table.kind == planner.RELAY_OVERLAP and table.sys_tile == triton_plan.grouped_config(CUDA)
    assert table.system_first
    assert planner.plan_relay_shape(step(CPU, prefix=None, table=100, graphed=False)).kind == planner.RELAY_EPILOGUE
    # the CPU (Triton's interpreter): never fused nor overlapped, whatever the step says
    assert planner.plan_relay_shape(step(CPU)).kind in (planner.RELAY_EPILOGUE, planner.RELAY_MERGE)


def test_decode_graph_plans_are_the_plans_of_their_steps(h200):
    """A graph's key (decode_graph_plan, from sizes alone) is the plan the captured step gets."""
    for rows, prefix, own, ctx in ((256, 8192, 128, 256), (64, 2048, 1000, 1024), (8, 512, 30, 256)):
        key = planner.decode_graph_plan(rows, 32, 8, 128, 2, 64, CUDA, prefix, None, rows * own, ctx)
        assert key == planner.plan_relay_shape(step(CUDA, rows, prefix, own, longest=ctx))
        assert hash(key) == hash(planner.plan_relay_shape(step(CUDA, rows, prefix, own, longest=ctx)))
    mixed = planner.decode_graph_plan(256, 32, 8, 128, 2, 64, CUDA, None, 4096, 256 * 100, 256)
    assert mixed.kind == planner.RELAY_OVERLAP
    assert mixed.sys_splits == triton_plan.grouped_splits(256, 32, 8, 4096, CUDA)


def test_fused_plans_deal_rows_evenly_over_the_kernels_programs():
    """A RELAY_FUSED plan orders its rows so that the chunks each program attends are even
    (program (m, h, split): rows whose first query row is among its 128, split = index
    among them mod splits); other plans keep the order."""
    rng = random.Random()

    def loads(lengths, g, splits):
        out: dict = {}
        for r, n in enumerate(lengths):
            m = r * g // 128
            b = (m, (r - -(-128 * m // g)) % splits)
            out[b] = out.get(b, 0) + max(1, -(-n // 64))
        return out
    ratios = []
    for _ in range(40):
        g, splits = rng.choice([1, 3, 4, 7, 8]), rng.choice([1, 2, 4, 8])
        n = rng.choice([rng.randint(1, 256), 256])
        lengths = [min(4096, int(rng.lognormvariate(5.8, 1.0))) + 1 for _ in range(n)]
        plan = AttentionPlan(planner.RELAY_FUSED, sys_splits=splits)
        order = planner.row_order(plan, lengths, g, 64)
        assert sorted(order) == list(range(n))  # a permutation of the step's rows
        dealt = [lengths[j] for j in order]
        got, before = loads(dealt, g, splits), loads(lengths, g, splits)
        assert got.keys() == before.keys()
        ratios.append(max(got.values()) / max(before.values()))
        if g in (1, 4, 8) and n % (128 // g) == 0:  # bins of equal rows: LPT's bound, the mean plus a row
            top = max(max(1, -(-x // 64)) for x in lengths)
            assert max(got.values()) <= sum(got.values()) / len(got) + top
        # the same rows in, the same order out: a step whose rows cross no chunk edge keeps it
        assert planner.row_order(plan, list(lengths), g, 64) == order
        assert planner.row_order(AttentionPlan(planner.RELAY_OVERLAP, 2), lengths, g, 64) is None
        assert planner.row_order(None, lengths, g, 64) is None
    assert sum(ratios) / len(ratios) < 0.9


def test_decode_tiles_read_block_ids_ahead_only_on_grids_that_leave_the_chip_idle():
    slots = 2 * triton_plan.num_sms(CPU)
    for keys, per_sm in ((128, 4), (4096, 3)):  # the 32-key tile; the 64-key one, larger with read-ahead
        small = paged_config(4, 64, CPU, 2, keys, num_programs=slots)
        assert small.bt_ahead and small.num_stages == 3 and small.per_sm == per_sm, small
        for full in (paged_config(4, 64, CPU, 2, keys, num_programs=slots + 1), paged_config(4, 64, CPU, 2, keys)):
            assert not full.bt_ahead and full.num_stages == 2 and full.per_sm == 4, full
    assert not paged_config(32, 64, CPU, 2, 4096, num_programs=1).bt_ahead  # prefill rows: unchanged


def test_short_decode_tile_carries_a_register_cap_on_cuda_only():
    """The full-grid 32-key decode tile is capped at 128 registers on CUDA (eight programs an
    SM instead of six); the interpreter, longer key ranges and prefill rows get no cap."""
    short = paged_config(4, 128, CUDA, 2, 300)  # paged_config only reads the device type here
    assert short.block_n == 32 and short.maxnreg == triton_plan.MAX_REGISTERS_SHORT_TILE == 128, short
    assert paged_config(4, 128, CPU, 2, 300).maxnreg is None
    assert paged_config(4, 128, CUDA, 2, 4096).maxnreg is None
    assert paged_config(64, 128, CUDA, 2, 300).maxnreg is None


def test_relay_context_launches_read_ahead_from_their_grid_and_the_baseline_does_not(monkeypatch):
    """Relay's context step plans read-ahead tiles: its split plan and its launch's tile both
    pass the grid (sequences x KV heads) to paged_config; the baseline's pass None and keep
    the tiles they were timed with."""
    seen = []
    real = triton_plan.paged_config

    def recording(*args, **kwargs):
        seen.append(args[5] if len(args) > 5 else kwargs.get("num_programs"))
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_plan, "paged_config", recording)
    relay = planner.plan_relay_shape(step(CPU, rows=3, prefix=24, own=40, heads=(4, 2, 16), graphed=False, block=16))
    assert relay.ctx_tiles and seen and all(n == 3 * 2 for n in seen), seen
    seen.clear()
    shape = step(CPU, rows=3, prefix=24, own=40, heads=(4, 2, 16), graphed=False, block=16)
    planner.context_tile(shape, 2, read_ahead=False, prefix_keys=24)
    planner.context_splits(shape, 24, read_ahead=False)
    assert seen == [None, None], seen


def test_split_plan_picks_powers_of_two_and_leaves_full_batches_whole():
    seen = set()
    for programs in range(1, 17):  # num_sms: 2 without CUDA, so 16 slots at per_sm=8
        for keys in (1, 100, 256, 1000, 5000, 20000):
            splits, per = split_plan(keys, programs, CPU, 64, per_sm=8)
            assert splits & (splits - 1) == 0, (programs, keys, splits)
            assert per % 64 == 0 and splits * per >= keys
            seen.add(splits)
    assert len(seen) > 3  # small batches over long prefixes really split
    assert split_plan(20000, 64, CPU, 64) == (1, 20032)  # programs fill every slot: no split


def test_warp_specialised_system_tile_is_chosen_by_its_grid_on_hopper_only(h200):
    """ws_pays: the unsplit grid of 128-row programs covers a quarter of the SMs; the tile
    goes only to sm_90 (Gluon), and never to the interpreter or prefill-sized problems."""
    # H200, 132 SMs: batch 256 (64 programs, llama2-7b and llama3-8b heads) takes it,
    # batch 64 (16 and 32 programs) does not
    assert ws_pays(256 * 4, 8, 132) and ws_pays(256, 32, 132)
    assert not ws_pays(64 * 4, 8, 132) and not ws_pays(64, 32, 132)
    assert ws_pays(33 * 128, 1, 132) and not ws_pays(32 * 128, 1, 132)  # 33 of 132 programs: a quarter
    assert not system_config(1024, 128, CPU, 2, 8).ws
    for capability, wanted in (((9, 0), WS_TILE), ((8, 0), DECODE_TILE), ((10, 0), DECODE_TILE)):
        h200(capability)
        assert system_config(1024, 128, CUDA, 2, 8) == wanted, capability
        assert system_config(256, 128, CUDA, 2, 8) == DECODE_TILE  # batch 64
        assert system_config(PREFILL_ROWS, 128, CUDA, 2, 8).num_warps == 8  # the prefill tile


def test_overlapped_step_keeps_the_64_row_tile_where_the_system_kernel_runs_beside_the_context(monkeypatch):
    """An overlapped step's warp-specialised tile (which holds a whole SM) gives way to
    DECODE_TILE where the system kernel fits beside the context; where the system step is
    the longer one it stays, planned for its own grid."""
    monkeypatch.setattr(triton_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_plan, "system_config", lambda *args: WS_TILE)

    def plan(batch, system, context):
        return plan_system_step(step(CPU, batch, system, context, block=16), overlapped=True)[1:]
    assert plan(256, 2048, 1024) == (1, DECODE_TILE)  # llama3-8b heads, a full batch of a 2,048-token job
    assert plan(256, 8192, 128) == (2, WS_TILE)  # the system step is the longer: 64 programs of 128 rows


def test_overlapped_step_plans_the_system_kernel_at_one_program_an_sm_where_the_context_is_larger(monkeypatch):
    monkeypatch.setattr(triton_plan, "num_sms", lambda device: 132)  # an H200
    tile = Tile(64, 64, 4, 3, per_sm=2)  # the decode tile: two programs an SM

    def planner_of(batch, system, context, hq, hkv):
        s = step(CPU, batch, system, context, heads=(hq, hkv, 128), block=16)
        work = overlap_work(s.groups, s.context_tokens, hq, hkv, 128, 2)
        plan = lambda resident: system_splits(s, tile, resident, work)[0]  # noqa: E731
        # the overlapped step puts the system kernel first only where it is matrix-bound
        plan.first = triton_plan.matrix_bound(*work[:2])
        return plan

    # llama3-8b heads, a full batch at 2,048 prefix tokens in a 1,024-key context bucket:
    # 128 programs of one split take one slot an SM; two an SM would take 2 splits
    plan = planner_of(256, 2048, 1024, 32, 8)
    assert plan(True) == 1 and plan(False) == 2
    # batch 64: 32 programs are enough to finish under the context step (two an SM: 4 splits)
    plan = planner_of(64, 2048, 1024, 32, 8)
    assert plan(True) == 1 and plan(False) == 4
    # 8,192 prefix tokens, 128 own: the system step is the larger one and keeps its plan
    plan = planner_of(256, 8192, 128, 32, 8)
    assert plan(True) == plan(False) == 2
    plan = planner_of(64, 8192, 128, 32, 8)
    assert plan(True) == plan(False) == 8 and plan.first
    # llama2-7b heads at batch 64: a byte-bound system step would share the bandwidth, not hide
    plan = planner_of(64, 8192, 128, 32, 32)
    assert not plan.first  # and the context kernel goes first
    # at batch 256 it is matrix-bound and the context (537 MB) the larger step
    assert planner_of(256, 8192, 128, 32, 32)(True) == 1 and planner_of(256, 8192, 128, 32, 32).first


def test_default_impl_by_device():
    assert planner.default_impl(CPU) in ("cpu-flash", "torch")
    assert not planner.triton_available(CPU)


def test_the_planner_loads_without_triton():
    """The engine loads the planner (kernels/backend.py) before the CPU tests set
    TRITON_INTERPRET: it must not import Triton, whose own helpers would then be compiled
    functions that the interpreted kernels cannot call."""
    import subprocess
    import sys
    code = "import sys, relaycli.kernels.backend, relaycli.engine.cuda_graph; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

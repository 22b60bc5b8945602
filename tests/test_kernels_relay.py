"""Relay attention in Triton (kernels/triton_ops.py: the planner's plan of a step, executed)
against kernels/reference.py and float64 textbook attention, whatever plan the step is
forced to, and with rows of several prefixes in one PrefixTable. Inputs are fresh random
draws on every run."""

import dataclasses
import math
import random

import pytest
import torch

from tests.helpers_attention import random_problem
from tests.helpers_kernels import (DEVICE, TOL, baseline_with, gpu, interpret_on_cpu, make, rel_err, relay_plan,
                                   relay_reference, shapes, textbook, upcast)

interpret_on_cpu()

from relaycli.kernels import planner  # noqa: E402
from relaycli.kernels import reference as ref  # noqa: E402
from relaycli.kernels.metadata import LayerPrefixes, PrefixTable, prefix_table_rows  # noqa: E402
from relaycli.kernels.tiles import Tile  # noqa: E402
from relaycli.kernels.triton_ops import execute, prefix_paged_attention, relay_attention  # noqa: E402

SMALL_CTX = Tile(16, 16, 4, 2)  # many tiles, so splits really cut


def forced(plan, q, kind, sys_splits=None, ctx_splits=None, sys_tile=None, ctx_tile=None, system_first=None):
    """The planner's plan made `kind`, with these parts forced where the step has them (a
    system part only where it has prefix groups) and a merge for the whole batch."""
    changes = dict(kind=kind, merge=planner.merge_tile(q.shape[0], q.shape[1], q.shape[2], q.device))
    if plan.sys_tile is not None:
        changes.update({k: v for k, v in dict(sys_splits=sys_splits, sys_tile=sys_tile).items() if v is not None})
    if ctx_splits is not None:
        changes["ctx_splits"] = ctx_splits
    if ctx_tile is not None:
        changes["ctx_tiles"] = (ctx_tile,)
    if system_first is not None:
        changes["system_first"] = system_first
    return dataclasses.replace(plan, **changes)


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
    plan = relay_plan(q, kc, vc, meta, prefixes)
    if mode == "fused-6":  # six partials folded in by the context epilogue: a full and a partial chunk
        plan = forced(plan, q, planner.RELAY_EPILOGUE, sys_splits=6, ctx_splits=1, sys_tile=Tile(16, 16, 4, 2))
    elif mode == "split":  # system split 3 ways, context split 2 ways: partials meet in the merge kernel
        plan = forced(plan, q, planner.RELAY_MERGE, sys_splits=3, ctx_splits=2, ctx_tile=SMALL_CTX)
    elif mode == "overlap":  # context as one more partial (the other stream on CUDA), then the merge kernel
        plan = forced(plan, q, planner.RELAY_OVERLAP)
    elif mode == "overlap-system-side":  # the system kernel first, on the side stream
        plan = forced(plan, q, planner.RELAY_OVERLAP, system_first=True)
    elif mode == "overlap-context-first":  # the context kernel first
        plan = forced(plan, q, planner.RELAY_OVERLAP, system_first=False)
    got = relay_attention(q, kc, vc, meta, prefixes, scale) if mode == "default" else \
        execute(plan, q, kc, vc, meta, prefixes, scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert rel_err(got, relay_reference(q, kc, vc, prefixes, meta, scale)) < TOL[dtype]
    assert rel_err(got, textbook(shape, q, kc, vc, prefixes, meta, scale)) < TOL[dtype]


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
        got = baseline_with(q, kc, vc, meta, prefixes, scale, splits, SMALL_CTX)
        assert torch.equal(got[pad], torch.zeros_like(got[pad]))
        if real:
            assert rel_err(got[real], want_base[real]) < TOL[dtype]
    plan = relay_plan(q, kc, vc, meta, prefixes)
    for got in (relay_attention(q, kc, vc, meta, prefixes, scale),
                execute(forced(plan, q, planner.RELAY_OVERLAP), q, kc, vc, meta, prefixes, scale)):
        assert torch.isfinite(got).all()  # padding keeps its system part; it is dropped anyway
        if real:
            assert rel_err(got[real], want_relay[real]) < TOL[dtype]


def table_problem(rng: random.Random, dtype: torch.dtype, num_groups: int, num_prefixes: tuple[int, int] = (2, 5),
                  rows_per_group: int = 7):
    """A decode step whose rows use several prefixes, ordered by group (rows without a
    prefix last, some padding rows past the batch), with its PrefixTable over a store whose
    slots are not in slot order."""
    num_kv, group = rng.choice([(1, 1), (2, 3), (2, 4)])
    prefix_lens = [rng.randint(1, 150) for _ in range(rng.randint(*num_prefixes))]
    order = sorted(rng.sample(range(len(prefix_lens)), rng.randint(1, min(num_groups, len(prefix_lens)))))
    rng.shuffle(order)
    prefix_of = [slot for slot in order for _ in range(rng.randint(1, rows_per_group))]
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
    # slot 0 dropped and taken again, as a module path's slot is: its rows lie past the
    # others' in the store (the same values), so the table's key ranges are out of slot order
    total = sum(k.shape[0] for k, _ in prefixes)
    layer = LayerPrefixes.stored(prefixes, capacity=total + 1).without({0}).appended([prefixes[0]], slot=0)
    assert layer.ranges()[0][0] == total - prefix_lens[0]
    slots = [s if s < len(prefix_lens) else None for s in prefix_of] + [None] * pad
    row_group, rows = prefix_table_rows(slots, layer.ranges(), num_groups)
    table = PrefixTable(torch.tensor(row_group, dtype=torch.int32, device=DEVICE),
                        torch.tensor(rows, dtype=torch.int32, device=DEVICE), num_groups, max(prefix_lens))
    tabled = dataclasses.replace(meta, prefix_groups=[], prefix_table=table, _cache={})
    return q, kc, vc, layer, meta, tabled, n, 1.0 / math.sqrt(q.shape[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_a_prefix_table_step_equals_the_step_with_its_groups_listed(dtype, seed):
    """Rows of several prefixes in one step, described as device data (one grouped system
    launch over the prefix store, split as planned or 1-3 ways; the baseline one launch
    reading each row's prefix range) give what the per-group launches give, for relay and
    the baseline alike."""
    rng = random.Random(seed)
    q, kc, vc, layer, meta, tabled, n, scale = table_problem(rng, dtype, num_groups=rng.choice([5, 8]))
    qf, kf, vf, pf = upcast(q, kc, vc, list(layer))
    want_relay = ref.relay_attention(qf, kf, vf, meta, pf, scale)
    want_base = ref.prefix_paged_attention(qf, kf, vf, meta, pf, scale)
    plan = relay_plan(q, kc, vc, tabled, layer)
    assert plan.sys_tile is not None and plan.sys_splits >= 1  # the grouped system kernel's
    overlap = forced(plan, q, planner.RELAY_OVERLAP, sys_splits=rng.choice([1, 2, 3]))
    for got, want in ((relay_attention(q, kc, vc, tabled, layer, scale), want_relay),
                      (execute(overlap, q, kc, vc, tabled, layer, scale), want_relay),
                      (prefix_paged_attention(q, kc, vc, tabled, layer, scale), want_base),
                      (baseline_with(q, kc, vc, tabled, layer, scale, 2), want_base)):
        assert rel_err(got[:n], want[:n]) < TOL[dtype]


@pytest.mark.parametrize("seed", range(2))
def test_a_prefix_table_step_with_as_many_small_groups_as_a_graph_holds(seed):
    """A library of many modules (or many artifacts): up to MAX_TABLE_GROUPS prefixes of
    one or two rows each in one step, so a tile meets several groups, each read once."""
    from relaycli.engine.cuda_graph import MAX_TABLE_GROUPS
    rng = random.Random(100 + seed)
    q, kc, vc, layer, meta, tabled, n, scale = table_problem(
        rng, torch.float32, num_groups=MAX_TABLE_GROUPS, num_prefixes=(MAX_TABLE_GROUPS - 4, MAX_TABLE_GROUPS),
        rows_per_group=2)
    assert len({int(g) for g in tabled.prefix_table.row_group[:n]}) > 16
    qf, kf, vf, pf = upcast(q, kc, vc, list(layer))
    assert rel_err(relay_attention(q, kc, vc, tabled, layer, scale)[:n],
                   ref.relay_attention(qf, kf, vf, meta, pf, scale)[:n]) < TOL[torch.float32]
    assert rel_err(prefix_paged_attention(q, kc, vc, tabled, layer, scale)[:n],
                   ref.prefix_paged_attention(qf, kf, vf, meta, pf, scale)[:n]) < TOL[torch.float32]


def test_prefix_table_rows_number_runs_and_refuse_unordered_rows():
    # slot 1 sits past slot 2 in the store (a reused slot takes the free rows at the end)
    row_group, rows = prefix_table_rows([2, 2, 0, None, None], [(0, 5), (8, 7), (5, 3)], 3)
    assert row_group == [0, 0, 1, 3, 3]
    assert rows == [(0, 2, 5, 3), (2, 3, 0, 5), (0, 0, 0, 0), (0, 0, 0, 0)]
    with pytest.raises(ValueError, match="last"):
        prefix_table_rows([None, 0], [(0, 5)], 2)
    with pytest.raises(ValueError, match="not together"):
        prefix_table_rows([0, 1, 0], [(0, 5), (5, 5)], 4)
    with pytest.raises(ValueError, match="holds 1"):
        prefix_table_rows([0, 1], [(0, 5), (5, 5)], 1)


def test_relay_without_prefix_groups_is_context_attention():
    shape = shapes(random.Random(), decode=False)
    q, kc, vc, prefixes, meta, scale = make(shape, torch.float32)
    meta.prefix_groups = []
    got = relay_attention(q, kc, vc, meta, prefixes, scale)
    assert rel_err(got, ref.context_attention(q, kc, vc, meta, scale)[0]) < 1e-4
    assert rel_err(prefix_paged_attention(q, kc, vc, meta, prefixes, scale), got) < 1e-4


def test_relay_rejects_bad_inputs():
    q, kc, vc, prefixes, meta, scale = make(shapes(random.Random(), decode=True), torch.float32)
    with pytest.raises(AssertionError, match="dtypes differ"):
        relay_attention(q.half(), kc, vc, meta, prefixes, scale)
    with pytest.raises(AssertionError, match="unit last stride"):
        relay_attention(q, kc.transpose(-1, -2), vc.transpose(-1, -2), meta, prefixes, scale)
    with pytest.raises(AssertionError, match="plan kind"):
        planner.AttentionPlan("one-grid")


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
    plan = relay_plan(q, kc, vc, meta, prefixes)
    for got, want_ref in ((relay_attention(q, kc, vc, meta, prefixes, scale), want_relay),
                          (execute(forced(plan, q, planner.RELAY_OVERLAP), q, kc, vc, meta, prefixes, scale),
                           want_relay),
                          (execute(forced(plan, q, planner.RELAY_OVERLAP, system_first=True), q, kc, vc, meta,
                                   prefixes, scale), want_relay),
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
    the context (kernels/system_plan.py), and both replay to the relay reference. bucket: the
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
    out.copy_(relay_attention(q, kc, vc, meta, prefixes, scale))  # a graph's eager pass compiles its kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(relay_attention(q, kc, vc, meta, prefixes, scale))
    assert kinds and set(kinds) == {want_ws}, kinds
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    qf, kf, vf, pf = upcast(q, kc, vc, prefixes)
    assert rel_err(out, ref.relay_attention(qf, kf, vf, meta, pf, scale)) < TOL[dtype]

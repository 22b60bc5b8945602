"""The static buffers behind decode CUDA graphs compute the same logits as the eager
step: padding rows, scratch block, context bucket. (Capture itself needs CUDA; the
device script checks graphed against eager generation on the GPU.)"""

import random

import numpy as np
import pytest
import torch

from relaycli.models.registry import load_model
from relaycli.compile import prefix_from_ids
from relaycli.config import EngineConfig
from relaycli.engine.cuda_graph import (BATCH_BUCKETS, EAGER_TOO_MANY_PREFIXES, MAX_GRAPHS, MAX_TABLE_GROUPS, MIXED,
                                        DecodeGraphs, decode_rows, pack_block_tables)
from relaycli.engine.engine import Engine, TokenRequest
from relaycli.engine.sequence import SamplingOptions, Sequence


def test_static_buffers_match_the_eager_decode_step():
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    rng = random.Random()
    ids = [rng.randrange(lm.config.vocab_size) for _ in range(rng.randint(1, 100))]
    engine = Engine(lm, [prefix_from_ids(lm, ids)], EngineConfig(max_num_seqs=8, kv_cache_gb=0.01))
    for i in range(5):
        own = [rng.randrange(lm.config.vocab_size) for _ in range(rng.randint(1, 40))]
        engine._admit(TokenRequest(i, str(i), own, SamplingOptions(max_tokens=50), prefix_slot=0))
    runner = engine.runner
    graphs = DecodeGraphs(runner, 8, scratch_block=runner.num_blocks)
    seqs, is_prefill = engine.scheduler.schedule()
    runner.run(seqs, True)  # appends each sequence's first token
    for step in range(4):
        seqs, is_prefill = engine.scheduler.schedule()
        assert not is_prefill
        if step == 2:
            seqs = seqs[:3]  # a smaller batch after a larger one: stale rows must be reset
        key = graphs.key(seqs)
        bs, ctx, slot, plan = key
        assert bs >= len(seqs) and ctx >= max(s.num_own_tokens for s in seqs) and slot == 0
        assert plan is None  # only relay's Triton step plans its system kernel
        graphs._fill(seqs, bs, ctx, runner.decode_input_ids(seqs, None))
        graphed = graphs._forward(bs, graphs._meta(key))[:len(seqs)]
        input_ids, positions, meta, last_rows = runner.prepare(seqs, False)
        eager = lm.model.compute_logits(lm.model(input_ids, positions, runner.attention.attend_fn(meta))[last_rows])
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
        for s, t in zip(seqs, eager.argmax(-1).tolist()):
            s.num_cached_own = s.num_own_tokens
            s.output_ids.append(t)


def test_a_step_of_several_prefixes_fills_one_graphs_table_and_matches_the_eager_step():
    """Rows of three prefixes and rows of none in one decode step: one MIXED key whatever
    the mix, the rows ordered by prefix, and the graph's buffers (the PrefixTable's rows and
    groups) compute the eager step's logits; a smaller mix after a larger one too."""
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    rng = random.Random()
    vocab = lm.config.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(3)]
    engine = Engine(lm, [prefix_from_ids(lm, ids, f"p{i}") for i, ids in enumerate(prefixes)],
                    EngineConfig(max_num_seqs=16, kv_cache_gb=0.01))
    for i in range(12):
        slot = rng.choice([0, 1, 2, None])
        own = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        engine._admit(TokenRequest(i, str(i), own,
                                   SamplingOptions(max_tokens=50), prefix_slot=slot))
    runner = engine.runner
    graphs = DecodeGraphs(runner, 16, scratch_block=runner.num_blocks)
    seqs, _ = engine.scheduler.schedule()
    runner.run(seqs, True)
    keys = set()
    for step in range(4):
        seqs, is_prefill = engine.scheduler.schedule()
        if step == 2:
            seqs = [s for s in seqs if s.prefix_slot in (None, 2)] + [s for s in seqs if s.prefix_slot == 1][:1]
        key = graphs.key(seqs)
        assert key is not None and key[2] == (MIXED if len({s.prefix_slot for s in seqs}) > 1 else seqs[0].prefix_slot)
        keys.add(key[2])
        seqs = graphs.deal(seqs, key)
        order = [3 if s.prefix_slot is None else s.prefix_slot for s in seqs]
        assert order == sorted(order)
        bs, ctx, slot, _ = key
        graphs._fill(seqs, bs, ctx, runner.decode_input_ids(seqs, None), mixed=slot == MIXED)
        graphed = graphs._forward(bs, graphs._meta(key))[:len(seqs)]
        input_ids, positions, meta, last_rows = runner.prepare(seqs, False)
        eager = lm.model.compute_logits(lm.model(input_ids, positions, runner.attention.attend_fn(meta))[last_rows])
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
        for s, t in zip(seqs, eager.argmax(-1).tolist()):
            s.num_cached_own = s.num_own_tokens
            s.output_ids.append(t)
    assert MIXED in keys


def test_steps_past_the_graphs_bounds_run_eagerly_and_say_why():
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=0)
    many = [prefix_from_ids(lm, [i + 1, i + 2], f"p{i}") for i in range(MAX_TABLE_GROUPS + 1)]
    engine = Engine(lm, many, EngineConfig(max_num_seqs=MAX_TABLE_GROUPS + 8, kv_cache_gb=0.01))
    graphs = DecodeGraphs(engine.runner, MAX_TABLE_GROUPS + 8, scratch_block=engine.runner.num_blocks)
    seqs = [Sequence(i, [7], SamplingOptions(max_tokens=4), 2, i) for i in range(MAX_TABLE_GROUPS + 1)]
    assert graphs.key(seqs) is None and graphs.eager_reason == EAGER_TOO_MANY_PREFIXES
    assert graphs.key(seqs[:MAX_TABLE_GROUPS])[2] == MIXED


def test_past_max_graphs_a_new_key_replaces_the_least_recently_replayed_graph():
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=0)
    engine = Engine(lm, [], EngineConfig(max_num_seqs=8, kv_cache_gb=0.01))
    graphs = DecodeGraphs(engine.runner, 8, scratch_block=engine.runner.num_blocks)
    for i in range(MAX_GRAPHS):
        graphs.graphs[(1, 256 * (i + 1), None, None)] = object()  # captured (on CUDA)
    seq = Sequence(0, [7], SamplingOptions(max_tokens=4))
    assert graphs.key([seq]) is not None  # graphed, never eager for want of room
    first = next(iter(graphs.graphs))
    graphs.graphs[first] = graphs.graphs.pop(first)  # replayed last (DecodeGraphs.run)
    second = list(graphs.graphs)[0]
    graphs.make_room()
    assert len(graphs.graphs) == MAX_GRAPHS - 1 and graphs.num_evicted == 1
    assert second not in graphs.graphs and first in graphs.graphs


def test_decode_rows_are_each_rows_position_slot_and_context():
    """The arrays a graphed step is filled from equal what each sequence says of its last token."""
    rng = random.Random(3)
    for block_size in (1, 16, 64):
        seqs = []
        for i in range(50):
            prefix = rng.choice([0, rng.randrange(1, 5000)])
            seq = Sequence(i, [1] * rng.randint(1, 300), SamplingOptions(max_tokens=8), num_prefix_tokens=prefix,
                           prefix_slot=None if prefix == 0 else rng.randrange(4), output_ids=[2] * rng.randint(0, 200),
                           first_position=rng.choice([None, rng.randrange(0, 4000)]))  # a module row's own positions
            seq.block_table = rng.sample(range(10 ** 5), -(-seq.num_own_tokens // block_size))
            seqs.append(seq)
        rows = decode_rows(seqs, block_size)
        last = [s.num_own_tokens - 1 for s in seqs]
        assert rows[0].tolist() == [s.position_base + i for s, i in zip(seqs, last)]
        assert rows[1].tolist() == [s.slot(i, block_size) for s, i in zip(seqs, last)]
        assert rows[2].tolist() == [s.num_own_tokens for s in seqs]


def test_pack_block_tables_equals_padded_lists():
    rng = random.Random()
    out = np.empty((16, 40), dtype=np.int32)
    for _ in range(20):
        width = rng.randint(1, 40)
        tables = [[rng.randrange(10**6) for _ in range(rng.randint(0, width))] for _ in range(rng.randint(0, 16))]
        fill = rng.randrange(10**6)
        got = pack_block_tables(tables, width, fill, out)
        want = [t + [fill] * (width - len(t)) for t in tables]
        assert got.shape == (len(tables), width) and got.tolist() == want
    with pytest.raises(ValueError, match="more than the 3 columns"):
        pack_block_tables([[1, 2, 3, 4]], 3, 0, out)


def test_capture_all_covers_every_key_and_its_passes_touch_only_the_scratch_block():
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    rng = random.Random()
    ids = [rng.randrange(lm.config.vocab_size) for _ in range(rng.randint(1, 50))]
    engine = Engine(lm, [prefix_from_ids(lm, ids)], EngineConfig(max_num_seqs=40, kv_cache_gb=0.01))
    runner = engine.runner
    graphs = DecodeGraphs(runner, 40, scratch_block=runner.num_blocks)
    keys = set(graphs.all_keys(40, 1500, [0]))
    for _ in range(200):  # any step within the limits maps to a listed key
        n = rng.randint(1, 40)
        seqs = [type("S", (), dict(prefix_slot=0, num_own_tokens=rng.randint(1, 1500)))() for _ in range(n)]
        assert graphs.key(seqs) in keys
    assert max(k[0] for k in keys) == 48 and max(k[1] for k in keys) == 4096  # the buckets just above 40 and 1,500
    # the warm-up pass of a capture, on reset rows, leaves every real block as it was
    for cache in runner.k_caches + runner.v_caches:
        cache.normal_()
        cache[-1].zero_()
    before = [c[:-1].clone() for c in runner.k_caches + runner.v_caches]
    for key in sorted(keys)[:4] + sorted(keys)[-2:]:
        # rows left pointing at real blocks by earlier steps
        graphs.slot_mapping.fill_(rng.randrange(runner.num_blocks * graphs.block_size))
        graphs.block_tables.fill_(rng.randrange(runner.num_blocks))
        graphs.context_lens.fill_(rng.randint(1, 20))
        graphs._reset_rows(0, key[0], -(-key[1] // graphs.block_size))
        graphs._forward(key[0], graphs._meta(key))
    for b, c in zip(before, runner.k_caches + runner.v_caches):
        assert torch.equal(b, c[:-1])
    assert not torch.equal(runner.k_caches[0][-1], torch.zeros_like(runner.k_caches[0][-1]))  # scratch was written


def test_batch_buckets_pad_little_where_the_matrix_products_are_bound_by_flops():
    """Every batch runs in the smallest bucket that holds it; from 64 rows on (where
    padding rows cost as much as real ones) a step pays for at most 31 of them up to 256
    and 63 above."""
    from types import SimpleNamespace
    this = SimpleNamespace(max_context=1 << 20, _plan=lambda bs, slot, tokens, ctx: None)
    for n in range(1, 513):
        bs, _, _, _ = DecodeGraphs._bucket(this, n, 10, None, 10 * n)
        assert bs >= n and all(b < n for b in BATCH_BUCKETS if b < bs)
        assert bs - n <= (bs // 2 if n <= 64 else 31 if n <= 256 else 63)


def test_batches_beyond_the_largest_bucket_run_eagerly():
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    engine = Engine(lm, [], EngineConfig(max_num_seqs=600, kv_cache_gb=0.01))
    graphs = DecodeGraphs(engine.runner, 600, scratch_block=engine.runner.num_blocks)
    seq = type("S", (), dict(prefix_slot=None, num_own_tokens=5))()
    assert graphs.max_bs == BATCH_BUCKETS[-1]
    assert graphs.key([seq] * BATCH_BUCKETS[-1])[0] == BATCH_BUCKETS[-1]
    assert graphs.key([seq] * (BATCH_BUCKETS[-1] + 1)) is None
    assert max(k[0] for k in graphs.all_keys(600, 5, [None])) == BATCH_BUCKETS[-1]


def test_graphs_key_on_the_attention_plan_of_the_real_own_keys(monkeypatch):
    """Relay's Triton step plans its system kernel by the step's own keys in all, not by
    its context bucket's bound: steps of one bucket that want other plans get graphs of
    their own, each captured at a total that plans the same, and all_keys lists them."""
    from types import SimpleNamespace

    from relaycli.kernels import planner, triton_plan
    from relaycli.kernels.tiles import DECODE_TILE, WS_TILE
    monkeypatch.setattr(triton_plan, "num_sms", lambda device: 132)  # an H200 (sm_90)
    monkeypatch.setattr(triton_plan, "system_config", lambda rows, d, device, elem, kv_heads: (
        WS_TILE if triton_plan.ws_pays(rows, kv_heads, 132) else DECODE_TILE))
    monkeypatch.setattr(triton_plan, "is_sm90", lambda device: False)  # 16-key blocks: no fused step anyway
    cuda = torch.device("cuda")  # the planner reads only its type here

    def plan(bs, num_heads, slot, tokens, ctx, mixed=False):  # llama3-8b heads under an 8,192-token prompt
        return planner.decode_graph_plan(bs, 32, 8, 128, 2, 16, cuda, 8192, None, tokens, ctx)
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=0)
    engine = Engine(lm, [prefix_from_ids(lm, [1, 2, 3])], EngineConfig(max_num_seqs=256, kv_cache_gb=0.01))
    graphs = DecodeGraphs(engine.runner, 256, scratch_block=engine.runner.num_blocks)
    graphs.attention = SimpleNamespace(graph_plan=plan)

    def seqs(lens):
        return [SimpleNamespace(prefix_slot=0, num_own_tokens=n) for n in lens]
    short, full = graphs.key(seqs([32] * 256)), graphs.key(seqs([200] * 256))
    # one bucket, two plans: the warp-specialised tile where the system step is the longer
    # (measured faster on the H200 at 32 own keys a row: docs/kernels.md)
    assert short[:3] == full[:3] == (256, 256, 0)
    assert short[3].sys_splits == 2 and short[3].sys_tile.ws
    assert full[3].sys_splits == 1 and not full[3].sys_tile.ws
    keys = graphs.all_keys(256, 256, [0])
    assert short in keys and full in keys and len(set(keys)) == len(keys)
    rng = random.Random()
    for _ in range(300):  # any step maps to a listed key
        n = rng.randint(1, 256)
        key = graphs.key(seqs([rng.randint(1, rng.choice([8, 64, 256])) for _ in range(n)]))
        assert key in keys, key
    for key in keys:  # a key's graph is captured at a total that plans as the key says
        meta = graphs._meta(key)
        assert plan(key[0], 32, 0, planner.context_tokens(meta), key[1]) == key[3]
    meta = graphs._meta(full)
    assert planner.context_tokens(meta) == meta.context_tokens <= 256 * 256
    meta.context_tokens = None  # without a total, a step is priced at its bucket's bound
    assert planner.context_tokens(meta) == meta.num_seqs * meta.max_context_len


def test_fused_tile_is_wide_where_a_kv_head_has_four_row_tiles():
    """The fused kernel's 128-key prefix tile (Q in shared memory) where a KV head has 4+ row
    tiles of 128 query rows: llama3-8b heads at batch 256 (measured faster on the H200) and
    128; not at batch 64, nor llama2-7b's G = 1 at 256 (measured slower: the own keys lead)."""
    from relaycli.kernels import triton_plan
    from relaycli.kernels.tiles import FUSED_WIDE_TILE, FusedTile
    assert triton_plan.fused_tile(256, 32, 8) == FUSED_WIDE_TILE
    assert triton_plan.fused_tile(128, 32, 8) == FUSED_WIDE_TILE
    assert triton_plan.fused_tile(97, 32, 8) == FUSED_WIDE_TILE  # 388 rows: 4 tiles, the last short
    assert triton_plan.fused_tile(96, 32, 8) == FusedTile()  # 384 rows: 3 tiles
    assert triton_plan.fused_tile(64, 32, 8) == FusedTile()
    assert triton_plan.fused_tile(256, 32, 32) == FusedTile()
    assert triton_plan.fused_tile(512, 32, 32) == FUSED_WIDE_TILE


def test_fused_decode_plan_follows_the_measured_table(monkeypatch):
    """Where the fused own-key step runs (sm_90, 64-key blocks, 16-bit) and pays: the
    rule in triton_plan.fused_decode_plan's docstring (measurements: docs/kernels.md)."""
    from relaycli.kernels import planner, triton_plan
    monkeypatch.setattr(triton_plan, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_plan, "is_sm90", lambda device: True)
    cpu = torch.device("cpu")

    def plan(batch, prefix, own, heads=(32, 8, 128), elem=2, block=64, longest=256):
        hq, hkv, d = heads
        return triton_plan.fused_decode_plan(batch, hq, hkv, d, elem, block, cpu, prefix, batch * own, longest)
    # llama3-8b heads: the shapes where it is faster, with the split counts timed there
    assert plan(256, 8192, 128) == 2 and plan(128, 8192, 128) == 4 and plan(64, 8192, 128) == 8
    assert plan(256, 2048, 128) == 2 and plan(256, 4096, 200) == 2
    assert plan(64, 16384, 128) == 8 and plan(64, 4096, 32) == 8 and plan(16, 8192, 128) is not None
    assert plan(256, 8192, 128, heads=(32, 32, 128)) == 2 and plan(64, 8192, 128, heads=(32, 32, 128)) == 4
    # where the overlapped plan is as fast or faster: its context kernel beside a resident system
    # kernel at batch 64 (more than twice as many own chunks as prefix tiles a program), and
    # a prefix too short to hide the own keys behind; a row longer than twice a program's
    # prefix tiles; ShareGPT-like rows (about 400 own keys) under a long prefix, dealt evenly
    assert plan(64, 2048, 128) == 8 and plan(64, 2048, 129) is None and plan(64, 4096, 300, longest=1024) is None
    assert plan(256, 64, 200) is None and plan(256, 1024, 128) is None and plan(256, 1024, 64) == 2
    assert plan(256, 8192, 128, longest=16384) is None and plan(256, 8192, 128, longest=8192) == 2
    assert plan(256, 4096, 300, longest=1024) is None and plan(256, 8192, 400, longest=4096) == 2
    assert plan(256, 2048, 400, longest=4096) is None
    # shapes the kernel does not take
    assert plan(256, 8192, 128, block=16) is None and plan(256, 8192, 128, elem=4) is None
    assert plan(256, 8192, 128, heads=(32, 2, 128)) is None and plan(256, 8192, 128, heads=(32, 8, 96)) is None
    assert plan(256, 8192, 128, heads=(9, 3, 64)) == 4 and plan(256, 8192, 128, heads=(28, 4, 128)) == 2
    assert plan(256, 0, 128) is None
    # at least 256 prefix keys a split: a short prefix is not split into empty ranges
    assert plan(1, 512, 8) == 2 and plan(1, 300, 8) == 1
    # a graph key is the fused plan with its splits; other keys the overlapped step's
    cuda = torch.device("cuda")  # the planner reads only its type here
    monkeypatch.setattr(torch.version, "hip", None)
    fused = planner.decode_graph_plan(256, 32, 8, 128, 2, 64, cuda, 8192, None, 256 * 128, 256)
    assert fused.kind == planner.RELAY_FUSED and fused.sys_splits == 2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton_plan, "smem_per_block", lambda device: 224 * 1024)
    other = planner.decode_graph_plan(256, 32, 8, 128, 2, 64, cuda, 8192, None, 256 * 128, 16384)
    assert other.kind == planner.RELAY_OVERLAP
    monkeypatch.setattr(triton_plan, "is_sm90", lambda device: False)
    assert plan(256, 8192, 128) is None


def test_engine_cache_blocks_default_by_device():
    """64-key blocks on CUDA (the fused step reads one a TMA chunk), 16 elsewhere; a config's
    block size wins."""
    from relaycli.kernels.triton_plan import default_block_size
    assert default_block_size(torch.device("cuda")) == 64 and default_block_size(torch.device("cpu")) == 16
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=0)
    assert Engine(lm, [], EngineConfig(kv_cache_gb=0.01)).runner.block_size == 16
    engine = Engine(lm, [], EngineConfig(kv_cache_gb=0.01, block_size=64))
    assert engine.runner.block_size == engine.block_manager.block_size == 64
    assert engine.runner.k_caches[0].shape[1] == 64


def test_graphs_run_their_rows_in_the_order_of_their_plan():
    """A graph whose plan is the fused own-key kernel runs its rows in the planner's order
    (kernels/planner.py row_order: tests/test_planner.py has its balance); other plans keep
    the order."""
    from types import SimpleNamespace

    from relaycli.kernels import planner
    rng = random.Random()
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=0)
    engine = Engine(lm, [], EngineConfig(max_num_seqs=256, kv_cache_gb=0.01, block_size=64))
    graphs = DecodeGraphs(engine.runner, 256, scratch_block=engine.runner.num_blocks)
    group = engine.runner.mc.num_attention_heads // engine.runner.mc.num_key_value_heads
    seqs = [SimpleNamespace(num_own_tokens=rng.randint(1, 900), prefix_slot=None) for _ in range(200)]
    fused = planner.AttentionPlan(planner.RELAY_FUSED, sys_splits=4)
    order = planner.row_order(fused, [s.num_own_tokens for s in seqs], group, 64)
    assert graphs.deal(seqs, (256, 1024, 0, fused)) == [seqs[j] for j in order] != seqs
    assert graphs.deal(seqs, (256, 1024, 0, planner.AttentionPlan(planner.RELAY_OVERLAP, 2))) is seqs
    assert graphs.deal(seqs, (256, 1024, None, None)) is seqs

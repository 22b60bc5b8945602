"""`relay bench`: workload lengths, the roofline arithmetic, and tiny runs through the CLI."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from typer.testing import CliRunner

from relaycli.bench.roofline import (Ceilings, ModelShape, attention_floor, decode_context_sum, decode_step_floor,
                                     floor_of, price_decode)
from relaycli.bench.workloads import WORKLOADS, LengthDist, RequestShape, get_workload, make_requests
from relaycli.cli import app

# ---- workloads ----------------------------------------------------------------------


def test_workload_is_deterministic_per_seed():
    spec = get_workload("sharegpt")
    a, b = make_requests(spec, 200, seed=7), make_requests(spec, 200, seed=7)
    assert a == b
    assert make_requests(spec, 200, seed=8) != a
    # The first requests do not depend on how many are drawn.
    assert make_requests(spec, 50, seed=7) == a[:50]
    # Pinned values: the generator (Python's random.Random) must not drift silently.
    assert [(r.input_len, r.output_len) for r in make_requests(spec, 3, seed=0)] == [(107, 164), (257, 148), (526, 47)]


def test_sharegpt_length_statistics():
    reqs = make_requests(get_workload("sharegpt"), 4000, seed=0)
    ins, outs = [r.input_len for r in reqs], [r.output_len for r in reqs]
    assert 115 <= statistics.median(ins) <= 141  # median 128 +- 10%
    assert 144 <= statistics.median(outs) <= 176  # median 160 +- 10%
    assert min(ins) >= 4 and max(ins) <= 1024 and min(outs) >= 4 and max(outs) <= 1024
    assert max(ins) == 1024  # sigma 1.0: the clip is reached in 4000 draws
    # log-normal: mean above median by about exp(sigma^2 / 2) before clipping
    assert statistics.mean(ins) > 1.3 * statistics.median(ins)


def test_fixed_workloads_and_output_clip():
    for name, (i, o) in (("fixed-128-256", (128, 256)), ("fixed-256-512", (256, 512))):
        assert set(make_requests(WORKLOADS[name], 10, seed=3)) == {RequestShape(i, o)}
    # any fixed-IN-OUT, not only the listed ones
    assert set(make_requests(get_workload("fixed-32-16"), 10, seed=3)) == {RequestShape(32, 16)}
    assert get_workload("fixed-7-1").describe() == {"name": "fixed-7-1", "input_tokens": "7", "output_tokens": "1"}
    full = make_requests(get_workload("sharegpt"), 100, seed=1)
    clipped = make_requests(get_workload("sharegpt"), 100, seed=1, max_output_len=32)
    assert [r.input_len for r in clipped] == [r.input_len for r in full]
    assert [r.output_len for r in clipped] == [min(32, r.output_len) for r in full]


def test_workload_validation():
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("sharegtp")
    for bad in ("fixed-0-16", "fixed-32", "fixed-32-16-8", "fixed--1-16", "fixed-a-b"):
        with pytest.raises(ValueError, match="fixed-IN-OUT"):
            get_workload(bad)
    with pytest.raises(ValueError):
        LengthDist(10, -1.0)
    with pytest.raises(ValueError):
        LengthDist(10, 1.0, low=20)
    with pytest.raises(ValueError):
        make_requests(get_workload("sharegpt"), 0, seed=0)


# ---- roofline -----------------------------------------------------------------------
# 2 layers, hidden 8, Hq 2, Hkv 1, D 4, intermediate 16, vocab 10, 2-byte weights:
#   per layer q 8*8 + k,v 2*8*4 + o 8*8 + mlp 3*8*16 = 64 + 64 + 64 + 384 = 576
#   matmul params 2*576 + lm_head 10*8 = 1232; norms (2*2+1)*8 = 40
#   weight bytes (1232 + 40) * 2 = 2544; KV bytes a token 2*2*1*4*2 = 32
SHAPE = ModelShape(layers=2, hidden=8, intermediate=16, q_heads=2, kv_heads=1, head_dim=4, vocab=10, dtype_bytes=2)


def test_model_shape_by_hand():
    assert SHAPE.matmul_params == 1232
    assert SHAPE.weight_bytes == 2544
    assert SHAPE.kv_bytes_per_token == 32


def test_decode_step_floor_by_hand():
    ceil = Ceilings(bandwidth=1000.0, matmul_rate=1000.0)
    # batch 3, system 10 tokens, own contexts summing to 15
    f = decode_step_floor(SHAPE, 3, 10, 15, ceil)
    assert f.bytes == 2544 + 32 * 10 + 32 * 15 == 3344
    assert f.flops == 2 * 1232 * 3 + 4 * 2 * 2 * 4 * (3 * 10 + 15) == 10272
    assert f.seconds == pytest.approx(10.272) and f.bound == "flops"
    # The same step if the system KV is read once per request (--no-relay's traffic).
    g = decode_step_floor(SHAPE, 3, 10, 15, ceil, system_once=False)
    assert g.bytes == 2544 + 32 * 30 + 32 * 15 == 3984 and g.flops == f.flops
    # Bytes-bound when the matmul rate is high.
    h = decode_step_floor(SHAPE, 3, 10, 15, Ceilings(1000.0, 1e9))
    assert h.bound == "bytes" and h.seconds == pytest.approx(3.344)


def test_prefill_and_job_floor_by_hand():
    from relaycli.bench.report import job_table
    from relaycli.bench.roofline import prefill_floor
    ceil = Ceilings(bandwidth=1000.0, matmul_rate=1000.0)
    # inputs of 2 and 3 tokens after a 10-token prefix: 5 tokens through the layers'
    # weights (1232 - 80 lm_head params), each request's last one through the lm_head,
    # each attends to the 10 prefix keys, and 1+2 + 1+2+3 = 9 own (causal) pairs
    f = prefill_floor(SHAPE, 10, [2, 3], ceil)
    assert f.flops == 2 * 1152 * 5 + 2 * 80 * 2 + 4 * 2 * 2 * 4 * (5 * 10 + 9) == 15616 and f.bytes == 2544
    assert f.seconds == pytest.approx(15.616) and f.bound == "flops"
    # the job: that prefill, then two decode steps of the hand case (batch 3, context 15)
    relay = {"system": "relay", "system_tokens": 10, "max_batch": 4, "requests": 2, "seconds": 100.0,
             "generated_tokens": 6, "decode_steps": 2, "decode_queries": 6, "decode_context_sum": 30,
             "decode_step_s": 20.0, "decode_step_log": [[3, 15, 20.0], [3, 15, 20.0]]}
    price_decode(relay, SHAPE, 10, ceil, input_lens=[2, 3])
    assert relay["job_floor_s"] == pytest.approx(15.616 + 2 * 10.272)
    assert relay["job_floor_fraction"] == pytest.approx(relay["job_floor_s"] / 100.0)
    assert relay["job_floor_requests_per_s"] == pytest.approx(2 / relay["job_floor_s"])
    base = dict(relay, system="no-relay", seconds=300.0, job_floor_fraction=relay["job_floor_s"] / 300.0)
    table = job_table({"rows": [relay, base]})
    most = list(table.columns[8]._cells)
    assert most == [f"{300.0 / relay['job_floor_s']:.2f}", "-"]  # relay at its floor vs the measured baseline


def test_price_decode_uses_the_mean_step():
    # Two decode steps with 6 queries and own contexts summing to 30: the mean step is the
    # hand case above (batch 3, context 15), floor 10.272 s, against 20.544 s measured.
    row = {"requests": 3, "seconds": 50.0, "generated_tokens": 9, "decode_steps": 2, "decode_queries": 6,
           "decode_context_sum": 30, "decode_step_s": 20.544}
    price_decode(row, SHAPE, 10, Ceilings(1000.0, 1000.0))
    assert row["mean_decode_batch"] == 3 and row["floor_bound"] == "flops"
    assert row["floor_step_s"] == pytest.approx(10.272) and row["floor_fraction"] == pytest.approx(0.5)
    assert row["tokens_per_s"] == pytest.approx(0.18) and row["requests_per_s"] == pytest.approx(0.06)
    assert "large_batch_floor_fraction" not in row  # no per-step log: nothing to price one by one


def test_price_decode_prices_large_batch_steps_one_by_one(monkeypatch):
    # The hand case again (batch 3, context 15: floor 10.272 s) with the large-batch limit
    # lowered to 3. Steps of batch 3 count, the batch-1 step does not.
    import relaycli.bench.roofline as roofline
    monkeypatch.setattr(roofline, "LARGE_BATCH", 3)
    row = {"requests": 3, "seconds": 50.0, "generated_tokens": 9, "decode_steps": 3, "decode_queries": 7,
           "decode_context_sum": 35, "decode_step_s": 15.0,
           "decode_step_log": [[3, 15, 20.544], [1, 5, 1.0], [3, 15, 10.272]]}
    price_decode(row, SHAPE, 10, Ceilings(1000.0, 1000.0))
    assert row["large_batch_steps"] == 2 and row["large_batch_step_s"] == pytest.approx(15.408)
    assert row["large_batch_floor_fraction"] == pytest.approx(2 * 10.272 / (20.544 + 10.272))


def test_steps_by_batch_groups_steps_into_equal_batch_ranges_by_hand():
    # Batch limit 8 in 4 ranges of 2: steps of batch 1, 2, 2 and 8. The range 1-2 holds
    # three steps (median 2.0 s, mean 5/3 s, mean batch 5/3, context 10) priced as one
    # step of that batch and context; the range 7-8 holds one step.
    from relaycli.bench.report import steps_table
    from relaycli.bench.roofline import steps_by_batch
    ceil = Ceilings(1000.0, 1000.0)
    log = [[1, 5, 1.0], [2, 10, 2.0], [2, 15, 2.0], [8, 40, 9.0]]
    bins = steps_by_batch(log, 8, SHAPE, 10, ceil, num_bins=4)
    assert [(b["batch_from"], b["batch_to"], b["steps"]) for b in bins] == [(1, 2, 3), (7, 8, 1)]
    low = bins[0]
    assert low["step_p50_s"] == 2.0 and low["step_mean_s"] == pytest.approx(5 / 3)
    assert low["mean_batch"] == pytest.approx(5 / 3) and low["mean_context"] == pytest.approx(10)
    assert low["floor_s"] == pytest.approx(decode_step_floor(SHAPE, 5 / 3, 10, 10, ceil).seconds)
    # The table folds the ranges into quarters of the limit: here the same two ranges.
    row = {"system": "relay", "system_tokens": 10, "max_batch": 8, "decode_steps_by_batch": bins}
    table = steps_table({"rows": [row, {"system": "hf", "system_tokens": 10, "max_batch": 8}]})
    assert table is not None and table.row_count == 2
    assert steps_table({"rows": [{"system": "hf"}]}) is None


def test_bench_and_run_stats_give_the_same_ttft_quantiles():
    """relay bench's rows and relay run's stats (EngineStats) report the same median and p90."""
    import random

    from relaycli.bench.report import ttft_stats
    from relaycli.engine.engine import EngineStats
    rng = random.Random()
    values = [rng.random() for _ in range(rng.randint(1, 50))]
    stats = EngineStats()
    for v in values:
        stats.add_ttft(v)
    run = stats.as_dict()
    bench = ttft_stats(values)
    assert bench["ttft_p50_s"] == run["ttft_p50_seconds"] and bench["ttft_p90_s"] == run["ttft_p90_seconds"]
    ordered = sorted(values)
    assert bench["ttft_p50_s"] == ordered[len(values) // 2]
    assert bench["ttft_p90_s"] == ordered[min(len(values) - 1, int(0.9 * len(values)))]
    assert ttft_stats([]) == {"ttft_mean_s": None, "ttft_p50_s": None, "ttft_p90_s": None}


@pytest.mark.parametrize("limit", [1, 2, 3, 10, 100, 256, 300])
def test_steps_table_rows_hold_exactly_the_batches_their_labels_name(limit):
    from relaycli.bench.report import steps_table
    from relaycli.bench.roofline import steps_by_batch
    log = [[b, 10 * b, 1.0] for b in range(1, limit + 1)]  # one step of every batch size
    bins = steps_by_batch(log, limit, SHAPE, 10, Ceilings(1000.0, 1000.0))
    assert all(1 <= b["batch_from"] <= b["batch_to"] <= limit for b in bins)
    row = {"system": "relay", "system_tokens": 10, "max_batch": limit, "decode_steps_by_batch": bins}
    table = steps_table({"rows": [row]})
    labels, counts = list(table.columns[3]._cells), list(map(int, table.columns[4]._cells))
    covered = []
    for label, count in zip(labels, counts):
        lo, hi = map(int, label.split("-"))
        assert 1 <= lo <= hi <= limit and count == hi - lo + 1  # one step per batch size in range
        covered += range(lo, hi + 1)
    assert covered == list(range(1, limit + 1)) and len(labels) <= 4


def test_attention_floor_and_context_sum_by_hand():
    ceil = Ceilings(bandwidth=100.0, matmul_rate=1e6)
    # Hq 4, Hkv 2, D 8, batch 2, system 16, own 3, 2 bytes:
    # KV 2*2*8*2 = 64 B a token: 64 * (16 + 2*3) = 1408; q and o 2*2*4*8*2 = 256
    f = attention_floor(4, 2, 8, 2, 16, 3, 2, ceil)
    assert f.bytes == 1664 and f.flops == 4 * 2 * 4 * 8 * 19 == 4864
    assert f.seconds == pytest.approx(16.64) and f.bound == "bytes"
    assert decode_context_sum(5, 4) == 6 + 7 + 8
    assert decode_context_sum(5, 1) == 0
    assert floor_of(10, 10, Ceilings(5, 2)).bound == "flops"


def test_roofline_validation():
    with pytest.raises(ValueError):
        ModelShape(2, 8, 16, 3, 2, 4, 10, 2)  # 3 q heads over 2 KV heads
    with pytest.raises(ValueError):
        Ceilings(0.0, 1.0)
    with pytest.raises(ValueError):
        decode_step_floor(SHAPE, 0, 10, 15, Ceilings(1.0, 1.0))


# ---- the CLI ------------------------------------------------------------------------


def test_bench_e2e_tiny_all_systems(tmp_path):
    out_json, out_png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    res = CliRunner().invoke(app, ["bench", "e2e", "--model", "dummy:tiny", "--workload", "fixed-128-256",
                                   "--requests", "4", "--system-tokens", "0,64", "--max-batch", "8",
                                   "--systems", "relay,no-relay,hf", "--max-output-len", "12", "--device", "cpu",
                                   "--json", str(out_json), "--plot", str(out_png), "--quiet"])
    assert res.exit_code == 0, res.output
    report = json.loads(out_json.read_text())
    rows = report["rows"]
    assert {(r["system"], r["system_tokens"]) for r in rows} == \
        {(s, n) for s in ("relay", "no-relay", "hf") for n in (0, 64)}
    for r in rows:
        assert "skipped" not in r, r
        assert r["requests"] == 4
        assert r["generated_tokens"] == 4 * 12, r  # requests * max_tokens, exactly
        assert r["tokens_per_s"] > 0 and r["ttft_p50_s"] is not None
        assert 0 < r["floor_fraction"] <= 1.0 and r["decode_steps"] > 0
        if r["system"] != "hf":
            assert r["exact_lengths"] and r["errors"] == 0
            assert r["decode_queries"] == 4 * 11
            assert 0 < r["job_floor_fraction"] < 1 and "prefill_input_lens" not in r
        if r["system"] == "hf":  # one batch of the 4 requests, not the limit of 8
            assert r["hf_batch"] == 4 and r["max_batch"] == 8, r
        if r["system"] != "relay":  # fp32 greedy on the same weights: the same ids, all three ways
            assert r["same_tokens_as_relay"] == "4/4", r
    assert report["workload"]["name"] == "fixed-128-256" and report["ceilings"]["bandwidth_bytes_per_s"] > 0
    for r in rows:  # engine rows: every decode step lands in one batch range
        if r["system"] != "hf":
            bins = r["decode_steps_by_batch"]
            assert sum(b["steps"] for b in bins) == r["decode_steps"] == len(r["decode_step_log"])
            assert all(b["batch_from"] <= b["mean_batch"] <= b["batch_to"] and b["floor_s"] > 0 for b in bins)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "relay" in res.stdout and "no-relay" in res.stdout  # the table
    assert "decode steps by batch size" in res.stdout and "whole jobs against their floor" in res.stdout
    # A run saved on one machine is shown and drawn on another.
    again = tmp_path / "again.png"
    res = CliRunner().invoke(app, ["bench", "show", str(out_json), "--plot", str(again)])
    assert res.exit_code == 0, res.output
    assert "no-relay" in res.stdout and again.read_bytes()[:4] == b"\x89PNG"


def test_bench_e2e_sampled(tmp_path):
    """--temperature/--top-p: every request samples with its own seed; the two engines draw
    the same tokens (same seeds, same fp32 logits), transformers samples on its own."""
    out_json = tmp_path / "s.json"
    res = CliRunner().invoke(app, ["bench", "e2e", "--model", "dummy:tiny", "--workload", "fixed-128-256",
                                   "--requests", "3", "--system-tokens", "32", "--max-batch", "4",
                                   "--systems", "relay,no-relay,hf", "--max-output-len", "10", "--device", "cpu",
                                   "--temperature", "0.8", "--top-p", "0.9", "--json", str(out_json), "--quiet"])
    assert res.exit_code == 0, res.output
    report = json.loads(out_json.read_text())
    assert report["options"]["temperature"] == 0.8 and report["options"]["top_p"] == 0.9
    assert "sampled at temperature 0.8 top_p 0.9" in res.stdout
    rows = {r["system"]: r for r in report["rows"]}
    for name in ("relay", "no-relay"):
        assert rows[name]["exact_lengths"] and rows[name]["generated_tokens"] == 3 * 10, rows[name]
    assert rows["no-relay"]["same_tokens_as_relay"] == "3/3"
    assert rows["hf"]["generated_tokens"] == 3 * 10 and rows["hf"].get("same_tokens_as_relay", "-") == "-"
    refused = CliRunner().invoke(app, ["bench", "e2e", "--model", "dummy:tiny", "--top-p", "0.9", "--device", "cpu"])
    assert refused.exit_code == 2 and "--temperature" in refused.output


def test_bench_e2e_repeats_report_the_median_run(tmp_path):
    """--repeats 3: each engine system runs three times, alternating; its row is the run of
    median time and lists every run; greedy runs generate the same ids every time;
    transformers runs once."""
    out_json = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "e2e", "--model", "dummy:tiny", "--workload", "fixed-128-256",
                                   "--requests", "3", "--system-tokens", "32", "--max-batch", "4",
                                   "--systems", "relay,no-relay,hf", "--max-output-len", "6", "--device", "cpu",
                                   "--repeats", "3", "--json", str(out_json)])
    assert res.exit_code == 0, res.output
    rows = {r["system"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert len(rows) == 3
    for name in ("relay", "no-relay"):
        r = rows[name]
        assert r["runs"] == 3 and len(r["seconds_runs"]) == 3 and len(r["requests_per_s_runs"]) == 3
        assert r["seconds"] == sorted(r["seconds_runs"])[1], r["seconds_runs"]
        assert r["requests_per_s"] == r["requests_per_s_runs"][r["seconds_runs"].index(r["seconds"])]
        assert r["same_ids_across_runs"] is True and r["exact_lengths"]
    assert "runs" not in rows["hf"] and rows["no-relay"]["same_tokens_as_relay"] == "3/3"
    assert res.output.count("(run 2 of 3)") == 2  # the two engines, not transformers
    assert "3 runs" in res.stdout
    refused = CliRunner().invoke(app, ["bench", "e2e", "--repeats", "0", "--device", "cpu"])
    assert refused.exit_code == 2 and "--repeats" in refused.output


def test_run_engine_samples_with_each_requests_seed():
    """The engine's sampled tokens differ from greedy ones, repeat for the same seeds, and
    do not depend on the batch limit (each request draws from its own seed)."""
    import random

    from relaycli.models.registry import load_model
    from relaycli.bench.e2e import run_engine
    lm = load_model("dummy:tiny", "float32", "cpu")
    rng = random.Random()
    shapes = [RequestShape(rng.randint(4, 12), 8) for _ in range(3)]
    own = [[rng.randrange(lm.config.vocab_size) for _ in range(r.input_len)] for r in shapes]
    hot = dict(temperature=1.0, top_p=1.0, top_k=None)
    greedy = run_engine(lm, None, shapes, own, 4, True, None)["_ids"]
    sampled = run_engine(lm, None, shapes, own, 4, True, None, sampling=hot)["_ids"]
    again = run_engine(lm, None, shapes, own, 1, True, None, sampling=hot)["_ids"]
    assert sampled == again and sampled != greedy


def test_bench_kernels_tiny(tmp_path):
    out_json = tmp_path / "k.json"
    res = CliRunner().invoke(app, ["bench", "kernels", "--model", "dummy:tiny", "--system-tokens", "0,48",
                                   "--max-batch", "3", "--context", "20", "--device", "cpu", "--json",
                                   str(out_json), "--quiet"])
    assert res.exit_code == 0, res.output
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["system"], r["system_tokens"]) for r in rows} == \
        {(k, s) for k in ("relay", "no-relay", "sdpa") for s in (0, 48)}
    for r in rows:
        assert r["rel_diff_vs_no_relay"] < 1e-5, r  # the same attention, three ways
        assert r["time_us"] > 0 and r["floor_us"] > 0


def test_build_step_with_unequal_lengths_attends_each_row_to_its_own_keys():
    """The probes' job-like steps: row b has lens[b] own keys (its last is the query's
    slot), max_context_len may be a graph's bucket, and relay over them is attention
    over the prefix and each row's own keys, checked in float64 row by row."""
    import torch

    from relaycli.kernels.reference import naive_attention, relay_attention
    from relaycli.bench.kernels import build_step
    gen = torch.Generator()
    gen.manual_seed(torch.seed())
    lens = [1, 17, 5, 33, 16]
    q, kc, vc, pre, meta = build_step(4, 2, 8, len(lens), 12, 0, torch.device("cpu"), torch.float32, gen,
                                      page=8, lens=lens, max_context_len=64)
    assert meta.context_lens.tolist() == lens and meta.max_context_len == 64
    assert meta.block_tables.shape == (len(lens), 5)  # ceil(33 / 8) columns
    tables = meta.block_tables.long()
    got = relay_attention(q, kc, vc, meta, pre, 8 ** -0.5)
    for b, n in enumerate(lens):
        last = n - 1
        assert meta.slot_mapping[b] == tables[b, last // 8] * 8 + last % 8
        k_own = kc[tables[b]].flatten(0, 1)[:n]
        v_own = vc[tables[b]].flatten(0, 1)[:n]
        k = torch.cat([pre[0][0], k_own])
        v = torch.cat([pre[0][1], v_own])
        want = naive_attention(q[b:b + 1], k, v, 8 ** -0.5, k.shape[0] - 1)[0]
        torch.testing.assert_close(got[b].double(), want, rtol=1e-5, atol=1e-6)
    assert tables.unique().numel() == tables.numel()  # no block shared by two rows


def test_bench_refuses_bad_options(tmp_path):
    res = CliRunner().invoke(app, ["bench", "e2e", "--system-tokens", "0,abc", "--device", "cpu"])
    assert res.exit_code == 2 and "--system-tokens" in res.output
    res = CliRunner().invoke(app, ["bench", "e2e", "--systems", "relay,vllm", "--device", "cpu"])
    assert res.exit_code == 2 and "vllm" in res.output
    res = CliRunner().invoke(app, ["bench", "kernels", "--json", "/nonexistent-dir/k.json", "--device", "cpu"])
    assert res.exit_code == 2 and "does not exist" in res.output
    res = CliRunner().invoke(app, ["bench", "kernels", "--json", str(tmp_path), "--device", "cpu"])
    assert res.exit_code == 2 and "is a folder; give a file name" in res.output
    res = CliRunner().invoke(app, ["bench", "kernels", "--plot", str(tmp_path / "p.txt"), "--device", "cpu"])
    assert res.exit_code == 2 and "--plot writes a PNG" in res.output
    res = CliRunner().invoke(app, ["bench", "kernels", "--l2-flush", "warm", "--device", "cpu", "--quiet"])
    assert res.exit_code == 2 and "--l2-flush must be one of clean, dirty" in res.output


def test_merge_reports_joins_split_runs():
    from relaycli.bench.report import merge_reports

    def rep(rows):
        return {"kind": "e2e", "model": "dummy:llama2-7b", "dtype": "bfloat16", "rows": rows,
                "workload": {"name": "sharegpt", "requests": 1000, "seed": 0, "max_output_len": None}}

    a = rep([{"system": "relay", "system_tokens": 8192, "max_batch": 64, "tokens_per_s": 300.0}])
    b = rep([{"system": "no-relay", "system_tokens": 8192, "max_batch": 64, "tokens_per_s": 100.0}])
    k = {"kind": "kernels", "rows": []}
    merged = merge_reports([a, k, b])
    assert [m["kind"] for m in merged] == ["e2e", "kernels"]
    assert [r["system"] for r in merged[0]["rows"]] == ["relay", "no-relay"]
    assert merged[0]["rows"][0]["speedup_vs_no_relay"] == pytest.approx(3.0)


def test_sweep_summary_compares_relay_with_its_floor_from_shortest_to_longest_prompt():
    from relaycli.bench.report import sweep_summary
    rows = [dict(system="relay", max_batch=64, system_tokens=s, requests_per_s=rps, floor_step_s=f)
            for s, rps, f in [(2048, 9.0, 0.011), (512, 10.0, 0.010), (16384, 7.0, 0.0125)]]
    rows += [dict(system="no-relay", max_batch=64, system_tokens=s, requests_per_s=1.0, floor_step_s=0.01)
             for s in (512, 16384)]
    rows += [dict(system="relay", max_batch=16, system_tokens=512, requests_per_s=3.0, floor_step_s=0.01),
             dict(system="relay", max_batch=16, system_tokens=512, skipped="too large")]
    (only,) = sweep_summary({"rows": rows})  # no-relay's floor is not its own; B=16 has one length
    assert (only["from_tokens"], only["to_tokens"], only["max_batch"]) == (512, 16384, 64)
    assert only["measured_change"] == pytest.approx(-0.3)
    assert only["predicted_change"] == pytest.approx(-0.2)
    assert only["points_over_prediction"] == pytest.approx(10.0)


def test_l2_flush_names_are_checked_before_any_cuda_work():
    from relaycli.bench.timing import cuda_median_us, l2_flusher
    with pytest.raises(ValueError, match="flush must be one of clean, dirty"):
        l2_flusher("hot")
    with pytest.raises(ValueError, match="flush must be one of clean, dirty"):
        cuda_median_us(lambda: None, "zero")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_timer_leaves_the_flush_out_of_the_timed_region():
    from relaycli.bench.timing import cuda_median_us
    x = torch.randn(1 << 24, device="cuda")
    # Each flush reads 256 MB; a run that does almost nothing
    # must time as almost nothing, whichever way the L2 is emptied.
    for flush in ("clean", "dirty"):
        assert 0 < cuda_median_us(lambda: x[:1].add_(1), flush) < 30


# ---- --through-run: the workload through `relay run` -------------------------------------


def test_through_run_texts_have_the_asked_token_lengths():
    """The system text's compiled prefix and each user prompt's own tokens (the rendered
    chat after the prefix, tokenized whole) have the asked lengths; below the template's
    own tokens, the shortest reachable."""
    import random

    from relaycli.models.registry import load_model
    from relaycli.bench.run_texts import TextFitError, WordBank, fit_system_text, fit_user_rows
    from relaycli.compile import TokenPrefix, shared_prefix_ids
    from relaycli.prompts import PromptMatcher
    tok = load_model("dummy:tiny", "float32", "cpu").tokenizer
    bank = WordBank(tok)
    assert bank.exact and all(len(tok.encode(w)) == 1 for w in bank.words[:200])
    assert all(len(tok.encode(w[1:])) == 1 for w in bank.heads[:200])
    rng = random.Random(3)
    for s in (9, 100, 1000):
        system = fit_system_text(tok, bank, s, rng)
        assert len(shared_prefix_ids(tok, system.text)) == len(system.prefix_ids) == s
    with pytest.raises(TextFitError, match="--system-tokens 2 is shorter than"):
        fit_system_text(tok, bank, 2, rng)
    matcher = PromptMatcher(tok, [TokenPrefix("sys", system.prefix_ids, [], [], system.text)])
    rows = fit_user_rows(matcher, bank, [1, 2, 9, 50, 300], rng)
    own = [len(tok.encode(tok.render_text([{"role": "system", "content": system.text},
                                           {"role": "user", "content": r.text}]))) - 1000 for r in rows]
    assert own[2:] == [9, 50, 300] and [len(r.own_ids) for r in rows] == own
    assert 2 < own[0] == own[1] < 9  # one word and the template's own tokens around it
    assert len({r.text for r in rows}) == len(rows)


def test_bench_e2e_through_run(tmp_path):
    """--through-run: rows.jsonl through `relay run` (one answer a row, no error rows)
    beside the engine alone on the same token ids: the same generated tokens and texts."""
    import pyarrow.parquet as pq

    from relaycli.artifact import read_artifact
    out_json, keep = tmp_path / "run.json", tmp_path / "files"
    args = ["bench", "e2e", "--through-run", "--model", "dummy:tiny", "--workload", "fixed-24-5", "--requests", "3",
            "--system-tokens", "40", "--max-batch", "4", "--device", "cpu", "--threads", "1"]
    res = CliRunner().invoke(app, [*args, "--keep", str(keep), "--json", str(out_json), "--quiet"])
    assert res.exit_code == 0, res.output
    report = json.loads(out_json.read_text())
    assert report["kind"] == "e2e-through-run" and report["files"] == str(keep)
    rows = {r["system"]: r for r in report["rows"]}
    assert set(rows) == {"relay", "no-relay"} and len(report["rows"]) == 2
    for r in rows.values():
        assert (r["system_tokens"], r["prefix_tokens"], r["max_batch"], r["requests"]) == (40, 40, 4, 3)
        assert r["host_own_tokens_exact"] == 3 and r["own_tokens_mean"] == 24
        assert r["run_rows"] == 3 and r["run_error_rows"] == 0 and r["run_exact_lengths"]
        assert r["run_generated_tokens"] == r["engine_generated_tokens"] == 3 * 5 and r["same_generated_tokens"]
        assert r["same_text_as_engine"] == "3/3"  # fp32 greedy: the same answers both ways
        assert r["run_prefix_hits"] == 3 and r["run_prefix_misses"] == 0 and r["run_cached_tokens"] == 3 * 40
        assert r["run_decode_steps"] == r["run_graphed_decode_steps"] + r["run_eager_decode_steps"] == 4
        assert 0 < r["run_job_s"] < r["run_process_s"]
        assert 0 < r["run_prefill_s"] and 0 < r["run_decode_s"]
        assert r["run_requests_per_s"] == pytest.approx(3 / r["run_job_s"])
        assert r["run_over_engine"] == pytest.approx(r["run_requests_per_s"] / r["engine_requests_per_s"])
        assert min(r["host_read_parse_us"], r["host_render_us"], r["host_prepare_us"]) > 0
        assert r["host_us_per_row"] == pytest.approx(r["host_read_parse_us"] + r["host_prepare_us"])
    relay, base = rows["relay"], rows["no-relay"]
    assert relay["engine_speedup_vs_no_relay"] == pytest.approx(
        relay["engine_requests_per_s"] / base["engine_requests_per_s"])
    assert relay["run_speedup_vs_no_relay"] == pytest.approx(relay["run_requests_per_s"] / base["run_requests_per_s"])
    assert "engine_speedup_vs_no_relay" not in base
    # The files a user can rerun: the rows, the artifact of S tokens, one answer per row.
    lines = [json.loads(x) for x in (keep / "s40" / "rows.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in x.items() if k != "prompt"} for x in lines] == [
        {"id": str(i), "max_tokens": 5, "ignore_eos": True, "temperature": 0.0, "top_p": 1.0, "seed": i}
        for i in range(3)]
    assert len(read_artifact(keep / "s40" / "sys.relaykv").token_ids) == 40
    for system in ("relay", "no-relay"):
        answers = pq.read_table(keep / "s40" / f"answers-{system}-b4.parquet").to_pylist()
        assert [a["id"] for a in answers] == ["0", "1", "2"]
        assert all((a["finish_reason"], a["prompt_tokens"], a["cached_tokens"], a["completion_tokens"])
                   == ("length", 64, 40, 5) for a in answers)
    assert "run/engine" in res.stdout and "no-relay" in res.stdout and "host work per row" in res.stdout
    shown = CliRunner().invoke(app, ["bench", "show", str(out_json)])
    assert shown.exit_code == 0 and "--through-run" in shown.stdout
    again = CliRunner().invoke(app, [*args, "--keep", str(keep)])  # the folder holds a run already
    assert again.exit_code == 2 and "already holds a run" in again.output


def test_bench_through_run_refuses_bad_options(tmp_path):
    cases = [(["--keep", str(tmp_path)], "--keep keeps the files of --through-run"),
             (["--through-run", "--systems", "relay,hf"], "drop 'hf' from --systems"),
             (["--through-run", "--plot", str(tmp_path / "p.png")], "drop --plot with --through-run"),
             (["--through-run", "--hf-requests", "2"], "--hf-requests is for transformers runs"),
             (["--through-run", "--system-tokens", "64,64"], "--system-tokens lists 64 more than once"),
             (["--through-run", "--system-tokens", "3", "--requests", "1"], "--system-tokens 3 is shorter than")]
    for extra, message in cases:
        res = CliRunner().invoke(app, ["bench", "e2e", "--model", "dummy:tiny", "--device", "cpu", *extra])
        assert res.exit_code == 2 and message in res.output, (extra, res.output)


def test_bench_jobs_refuses_an_unknown_part_before_any_work(tmp_path):
    result = CliRunner().invoke(app, ["bench", "jobs", "nope", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown part 'nope'" in result.output and "modules" in result.output
    assert not (tmp_path / "jobs.json").exists()


def test_the_modules_job_library_has_its_documented_shape(default_model, tmp_path):
    import random

    from relaycli.bench.jobs import ROOT, modules_library
    from relaycli.modules import parse_schema
    words = (ROOT / "examples/system_prompt.txt").read_text().split()
    path, system_text, docs_text = modules_library(tmp_path, words, (2048, 4096), random.Random(0))
    schema = parse_schema(path.read_text(), path)
    assert len(schema.modules) == 16 and all(m.after is None for m in schema.modules)
    assert schema.system_text == system_text and [m.pieces[0] for m in schema.modules] == docs_text
    tok = default_model.tokenizer
    system = len(tok.encode(schema.system_text))
    docs = [len(tok.encode(m.pieces[0])) for m in schema.modules]
    assert 900 <= system <= 1150, system
    assert all(1800 <= n <= 4600 for n in docs), docs

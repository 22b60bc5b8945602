"""A/B of the paged context kernel's software pipeline in whole jobs.

Runs relay on one workload several times, alternating variants of the decode context
tile that kernels/triton_context_attention.py's `paged_config` picks: `default`, or the
same tile with more pipeline stages and/or `bt_ahead` (block ids read one iteration
early, after which 3 stages double-buffer K/V; scripts/compile_report.py); `merge1` and
`merge4` merge the relay partials one or four splits at a time (the default picks by the
grid: triton_plan.merge_unroll), in every step, the fused ones included; `merge-rows` gives each
merge program all of a row's heads up to 2,048 values at any grid, as before the
twenty-fifth session (the default: triton_plan.merge_block_h, fewer where the grid is small); `small-*` change only the tiles of grids small enough
for paged_config to read block ids ahead; `bt3-32` reads ahead on every 32-key tile; `a+b`
combines two variants' changes; `no-maxnreg` drops the 32-key tile's register cap;
`short-N` gives decode key ranges up to N that tile; `context-first` and
`system-first-full` undo the overlapped step's plan (the system kernel first, at one
program an SM where the context is the larger step) in part; `sys-32x3`, `sys-32x4` and
`sys-64x2` give the decode system tile another key tile and stage count; `no-ws` keeps
the 64-row system tile where the warp-specialised one would run; `pdl` runs the
step on one stream, the context kernel a programmatic dependent of the system kernel;
`no-pdl-ops` launches the layer's small kernels plainly, as before the fifteenth session
(kernels.pdl); `ctx-64` adds a 64-key context bucket below the 256-key one (the decode
graphs of steps whose own contexts are that short plan their system step for 64 keys a
row, not 256); `ws-always` keeps the warp-specialised system tile wherever system_config
gives it, at its own split plan, instead of giving way to the 64-row tile where that fits
beside the context; `bucket-priced` plans the system step of a decode graph for its
context bucket's bound, one graph a bucket, as before the seventeenth session (the default
prices the step's real own keys, a graph for each plan); `no-fused` never runs the fused
own-key kernel (kernels/gluon_fused_relay.py), as before the twenty-third session; `no-deal`
runs a fused step's rows in the scheduler's order (the same ids as the default); `prefill-serial` reads a prefill
back before the next step launches, as the engine did before the eleventh session
(--no-relay times the baseline).
Each run is a fresh engine (its warm-up captures its own CUDA graphs), and every run
must generate the same greedy ids as the first (no variant changes the arithmetic).
Prints each run, then per variant the median of requests/s, of the share of the floor
reached by steps of batch 64 and more, and of the median step at batch 1-16; writes JSON
under $OUT.

    python scripts/device_ab_context.py [--model dummy:llama3-8b] [--system 2048] [--requests 500]
        [--max-batch 256] [--repeats 3] [--variants default,bt3,s5] [--no-relay]
        [--workload sharegpt | fixed-IN-OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import triton_context_attention as tca  # noqa: E402
from kernels import triton_ops, triton_plan  # noqa: E402
from kernels import triton_system_attention as tsa  # noqa: E402
from models.registry import load_model  # noqa: E402
from relaycli.bench.e2e import run_engine  # noqa: E402
from relaycli.bench.roofline import ModelShape, measure_ceilings, price_decode  # noqa: E402
from relaycli.bench.workloads import get_workload, make_requests  # noqa: E402
from relaycli.compile import prefix_from_ids  # noqa: E402
from relaycli.engine import cuda_graph, model_runner  # noqa: E402
from relaycli.engine.engine import Engine  # noqa: E402

# what each variant changes in the decode-sized tiles (BLOCK_M 16) of paged_config, or
# the merge of relay's partials
VARIANTS = {"default": {}, "bt3": dict(num_stages=3, bt_ahead=True), "bt4": dict(num_stages=4, bt_ahead=True),
            "s5": dict(num_stages=5), "bt2": dict(bt_ahead=True), "merge1": dict(merge_unroll=1),
            "merge4": dict(merge_unroll=4), "merge-rows": dict(merge_rows=True), "s2": dict(num_stages=2, bt_ahead=False),
            # only the tiles paged_config gives small grids (those that read block ids ahead)
            # (per_sm: the programs that fit an SM, which the split plan counts on)
            "small-s4": dict(small_only=True, num_stages=4, per_sm=2),
            "small-128": dict(small_only=True, BLOCK_N=128, num_warps=8, num_stages=3, per_sm=1),
            # the 32-key tile fits six programs an SM with or without bt_ahead (registers bind)
            "bt3-32": dict(block_n_only=32, num_stages=3, bt_ahead=True),
            # the engine before 08dac57: a prefill is read back before the next step launches
            "prefill-serial": dict(prefill_serial=True),
            # the 32-key tile without its register cap (six programs an SM instead of eight)
            "no-maxnreg": dict(drop_maxnreg=True),
            # decode key ranges up to 1024 (a graph's 1024-key context bucket) take the 32-key tile
            "short-1024": dict(short_tile_keys=1024), "short-512": dict(short_tile_keys=512),
            # the overlapped step's order and system split plan (triton_ops.relay_attention_with):
            # the context kernel first, as before the thirteenth session; the system kernel
            # first but planned for two programs an SM
            "context-first": dict(relay_kwargs=dict(system_side=False, resident=False)),
            "system-first-full": dict(relay_kwargs=dict(system_side=True, resident=False)),
            # the decode system tile (64 rows) with other key tiles / stages: less shared
            # memory a system program leaves more to the context programs beside it
            "sys-32x3": dict(sys_tile=dict(BLOCK_N=32, num_stages=3)),
            "sys-32x4": dict(sys_tile=dict(BLOCK_N=32, num_stages=4)),
            "sys-64x2": dict(sys_tile=dict(BLOCK_N=64, num_stages=2)),
            # the 64-row decode system tile where the warp-specialised one would run (before
            # the sixteenth session)
            "no-ws": dict(no_ws=True),
            # one stream: the context kernel a programmatic dependent of the system kernel,
            # folding its partials in (no merge kernel, no side stream)
            "pdl": dict(relay_kwargs=dict(pdl=True)),
            # the layer's small kernels (add + RMSNorm, RoPE, silu * up) launched plainly, as
            # before the fifteenth session, not as programmatic dependents (kernels.pdl)
            "no-pdl-ops": dict(plain_layer_ops=True),
            # a 64-key context bucket under the 256-key one (cuda_graph.MIN_CONTEXT_BUCKET)
            "ctx-64": dict(min_context_bucket=64),
            # the warp-specialised system tile kept wherever system_config gives it
            "ws-always": dict(ws_always=True),
            # the system plan priced at the context bucket's bound, one graph a bucket (before
            # the seventeenth session), not at the step's real own keys
            "bucket-priced": dict(bucket_priced=True),
            # the plans before the twenty-third session: no graphed step runs the fused own-key
            # kernel (kernels/gluon_fused_relay.py)
            "no-fused": dict(no_fused=True),
            # the fused step's rows in the scheduler's order, not dealt evenly over its programs
            # (cuda_graph.DecodeGraphs.deal): the same ids, since each row's arithmetic is its own
            "no-deal": dict(no_deal=True)}


def resolve(name: str) -> dict:
    """A variant's changes; `a+b` applies both (the later one wins on a shared key)."""
    change: dict = {}
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"unknown variant {part!r}; choose from {', '.join(VARIANTS)} (joined by +)")
        change.update(VARIANTS[part])
    return change


@contextmanager
def variant(change: dict):
    """paged_config and relay's merge as the variant has them, for the duration of a run."""
    change = dict(change)
    unroll = change.pop("merge_unroll", None)
    merge_rows = change.pop("merge_rows", False)
    small_only = change.pop("small_only", False)
    block_n_only = change.pop("block_n_only", None)
    prefill_serial = change.pop("prefill_serial", False)
    drop_maxnreg = change.pop("drop_maxnreg", False)
    short_keys = change.pop("short_tile_keys", tca.SHORT_TILE_KEYS)
    relay_kwargs = change.pop("relay_kwargs", None)
    sys_tile = change.pop("sys_tile", None)
    no_ws = change.pop("no_ws", False)
    plain_layer_ops = change.pop("plain_layer_ops", False)
    min_bucket_was = cuda_graph.MIN_CONTEXT_BUCKET
    min_bucket = change.pop("min_context_bucket", min_bucket_was)
    ws_always = change.pop("ws_always", False)
    bucket_priced = change.pop("bucket_priced", False)
    no_fused = change.pop("no_fused", False)
    no_deal = change.pop("no_deal", False)
    deal = cuda_graph.DecodeGraphs.deal
    fused_plan = triton_ops.fused_decode_plan
    graph_plan = cuda_graph.DecodeGraphs._plan
    plan = triton_ops.plan_system
    config, step, relay = tca.paged_config, Engine._step, triton_ops.relay_attention_with
    merge_unroll, merge_block_h = tsa.merge_unroll, tsa.merge_block_h  # merge_partials looks both up there
    sys_config = triton_plan.system_config

    def system_tile(rows, head_dim, device, elem=2, kv_heads=1):
        cfg = sys_config(rows, head_dim, device, elem, kv_heads)
        if no_ws and "ws" in cfg:
            cfg = dict(triton_plan.DECODE_TILE)
        return dict(cfg, **sys_tile) if sys_tile and cfg["BLOCK_M"] == 64 else cfg  # decode-sized only
    if sys_tile is not None or no_ws:  # both modules that plan or launch the system kernel
        triton_ops.system_config = tsa.system_config = system_tile

    def tile(rows_per_seq, head_dim, device, elem=2, keys=1 << 30, num_programs=None):
        cfg = config(rows_per_seq, head_dim, device, elem, keys, num_programs, short_keys=short_keys)
        applies = (cfg["BLOCK_M"] <= 16 and (cfg.get("bt_ahead", False) or not small_only)
                   and block_n_only in (None, cfg["BLOCK_N"]))
        if drop_maxnreg:
            cfg = {k: v for k, v in cfg.items() if k != "maxnreg"}
        return dict(cfg, **change) if applies else cfg
    tca.paged_config = tile
    cuda_graph.MIN_CONTEXT_BUCKET = min_bucket  # context_bucket and all_keys read it as they run
    if bucket_priced:  # one plan a bucket, and graphs captured without a total: priced at the bound
        cuda_graph.DecodeGraphs._plan = lambda graphs, bs, slot, tokens, ctx: None
    if ws_always:
        def plan_ws(sizes, num_heads, num_kv_heads, head_dim, elem, device, config, num_splits, resident, work):
            rows = max(n for n, _ in sizes) * (num_heads // num_kv_heads)
            tile = config or triton_ops.system_config(rows, head_dim, device, elem, num_kv_heads)
            if "ws" in tile:  # planned as a forced tile is: for its own grid, one program an SM
                config, resident = tile, False
            return plan(sizes, num_heads, num_kv_heads, head_dim, elem, device, config, num_splits, resident, work)
        triton_ops.plan_system = plan_ws
    if no_deal:
        cuda_graph.DecodeGraphs.deal = lambda graphs, seqs, key: seqs
    if no_fused:  # both of triton_ops' callers (the graph key's plan, the step) look it up there
        triton_ops.fused_decode_plan = lambda *args: None
    if unroll is not None:
        tsa.merge_unroll = lambda programs, device: unroll
    if merge_rows:
        tsa.merge_block_h = lambda num_rows, num_heads, head_dim, device: triton_plan.merge_row_block_h(
            num_heads, head_dim)
    if relay_kwargs is not None:  # relay_attention looks relay_attention_with up in its module
        triton_ops.relay_attention_with = functools.partial(relay, **relay_kwargs)
    ops_for = model_runner.layer_ops
    if plain_layer_ops:  # the runner looks layer_ops up in its module as it builds
        model_runner.layer_ops = lambda impl, device=None: ops_for(impl, None)
    if prefill_serial:
        def serial_step(engine):
            finished = []
            if engine._pending is not None and engine._pending.is_prefill:
                read, engine._pending = engine._pending, None
                finished = engine._read_back(read)
                engine._account(read, 0.0)  # on CUDA the device's timestamps set its time
            return finished + step(engine)
        Engine._step = serial_step
    try:
        yield
    finally:
        tca.paged_config, Engine._step = config, step
        tsa.merge_unroll, tsa.merge_block_h = merge_unroll, merge_block_h
        triton_ops.relay_attention_with = relay
        triton_ops.system_config = tsa.system_config = sys_config
        model_runner.layer_ops = ops_for
        cuda_graph.MIN_CONTEXT_BUCKET, triton_ops.plan_system = min_bucket_was, plan
        cuda_graph.DecodeGraphs._plan = graph_plan
        triton_ops.fused_decode_plan = fused_plan
        cuda_graph.DecodeGraphs.deal = deal


def percent(fraction: float | None) -> str:
    return "    -" if fraction is None else f"{100 * fraction:5.1f}%"


def small_batch_step(row: dict) -> float | None:
    """Median time in ms of the decode steps of at most 16 sequences (the log: batch, context, seconds)."""
    times = [t for batch, _, t in row.get("decode_step_log", []) if batch <= 16]
    return statistics.median(times) * 1e3 if times else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama3-8b")
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="default,bt3,s5")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-relay", action="store_true", help="time the --no-relay baseline instead of relay")
    ap.add_argument("--workload", default="sharegpt", help="sharegpt or fixed-IN-OUT (relaycli.bench.workloads)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    changes = {v: resolve(v) for v in variants}
    lm = load_model(args.model, args.dtype, args.device, seed=0)
    spec = get_workload(args.workload)
    shapes = make_requests(spec, args.requests, 0, None)
    need = args.system + max(r.input_len + r.output_len for r in shapes)
    lm.config.max_position_embeddings = max(lm.config.max_position_embeddings, need)
    rng = random.Random(1)
    vocab = lm.config.vocab_size
    own_ids = [[rng.randrange(vocab) for _ in range(r.input_len)] for r in shapes]
    prefix = prefix_from_ids(lm, [rng.randrange(vocab) for _ in range(args.system)], "ab") if args.system else None
    ceil = measure_ceilings(lm.model.device, lm.model.dtype)
    shape = ModelShape.from_config(lm.config, lm.model.dtype.itemsize)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)

    def save(summary: dict) -> None:  # after every run too, so a time limit keeps what ran
        (out / "ab_context.json").write_text(json.dumps(dict(args=vars(args), variants=changes, summary=summary,
                                                             runs=runs), indent=1, default=str))
    first_ids = None  # pipeline depth and bt_ahead change no arithmetic: every run's greedy ids must match
    for rep in range(args.repeats):
        for name in variants:
            with variant(changes[name]):
                row = run_engine(lm, prefix, shapes, own_ids, args.max_batch, not args.no_relay, None)
            ids = row.pop("_ids", None)
            first_ids = first_ids if first_ids is not None else ids
            row["same_ids_as_first_run"] = ids == first_ids
            price_decode(row, shape, args.system, ceil, input_lens=[r.input_len for r in shapes])
            row["small_batch_step_ms"] = small_batch_step(row)
            row.pop("decode_step_log", None)
            runs[name].append(row)
            save({})
            print(f"run {rep + 1} {name:12s} {row['requests_per_s']:7.2f} req/s  batch>=64 "
                  f"{percent(row.get('large_batch_floor_fraction'))} of floor  step p50 at batch 1-16 "
                  f"{row['small_batch_step_ms'] or float('nan'):6.2f} ms  exact={row['exact_lengths']} "
                  f"same ids={row['same_ids_as_first_run']}", flush=True)
    summary = {}
    for name, rows in runs.items():
        large = [r["large_batch_floor_fraction"] for r in rows if r.get("large_batch_floor_fraction") is not None]
        summary[name] = dict(
            requests_per_s=statistics.median(r["requests_per_s"] for r in rows),
            large_batch_floor_fraction=statistics.median(large) if large else None,
            small_batch_step_ms=statistics.median(r["small_batch_step_ms"] or float("nan") for r in rows))
        s = summary[name]
        print(f"median {name:12s} {s['requests_per_s']:7.2f} req/s  batch>=64 {percent(s['large_batch_floor_fraction'])}"
              f"  step p50 at batch 1-16 {s['small_batch_step_ms']:6.2f} ms  ({len(rows)} runs)", flush=True)
    save(summary)


if __name__ == "__main__":
    main()

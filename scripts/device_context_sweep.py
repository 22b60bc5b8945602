"""Tile configs of the decode context kernel (with the relay fusion) at engine-like shapes.

relay's decode step spends most of its attention time in the paged context kernel: each
request reads only its own few hundred keys, so the kernel is bound by latency more than
by bandwidth, and the tile config decides how many loads are in flight. This times the
candidates on the shapes `relay bench e2e` meets (ShareGPT-like own contexts of 16-800
tokens, a 2,048-token shared prefix), checks each against kernels/reference.py, and prints
GB/s and % of copy bandwidth. --graph-path times the whole relay decode attention the
way a CUDA-graphed step runs it (context on a side stream into partials, one merge) for
tile configs x context split counts, against the attention floor. --overlap times how
the system and context kernels share the chip in such a graph: fused (one after the
other, the merge in the context epilogue), context first on a side stream, or system
first on a high-priority side stream, with system split counts and pipeline depths
that leave room on each SM for context programs; each kernel alone gives the serial sum.
--grid times kernels/triton_relay_grid.py's one launch (both roles interleaved) in its
configs against the fused and context-first paths.
Usage: python scripts/device_context_sweep.py [--graph-path | --overlap | --grid] [--models llama3-8b]
       [--batches 256,64] [--system 2048,8192] [--own lo,hi]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from device_kernels import bench_us, ceilings  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.triton_context_attention import paged_attention, paged_config  # noqa: E402
from kernels.triton_ops import relay_attention, relay_attention_with  # noqa: E402
from kernels.triton_paged_decode import prefix_paged_attention  # noqa: E402
from kernels.triton_plan import split_plan, system_config  # noqa: E402
from kernels.triton_system_attention import merge_partials, system_attention_into  # noqa: E402
from relaycli.bench.kernels import build_step  # noqa: E402

CONFIGS = [dict(BLOCK_M=16, BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in
           [(16, 1, 2), (16, 2, 3), (16, 1, 4), (32, 1, 2), (32, 2, 2), (32, 1, 3), (32, 2, 3), (32, 2, 4),
            (32, 4, 2), (32, 2, 1), (64, 2, 2), (64, 4, 2), (64, 2, 3), (64, 4, 3), (64, 4, 1), (128, 4, 2),
            (16, 2, 5), (32, 2, 5), (32, 4, 5), (64, 4, 5)]]  # 5 stages: K/V double-buffered (compile_report.py)
# block ids read one iteration early: 3 stages double-buffer K/V, 4 triple-buffer them
# (128-key tiles with it: 136 KiB, one program an SM, for grids that leave SMs idle)
CONFIGS += [dict(BLOCK_M=16, BLOCK_N=n, num_warps=w, num_stages=s, bt_ahead=True) for n, w, s in
            [(32, 2, 2), (32, 2, 3), (32, 2, 4), (32, 4, 3), (64, 4, 3), (64, 4, 4), (16, 2, 3), (128, 4, 3),
             (128, 8, 3)]]


def parse_configs(text: str) -> list[dict]:
    """'64:4:3:a,32:2:2:r' -> decode tile configs (BLOCK_N:num_warps:num_stages, then flags:
    a for bt_ahead, r for a 128-register cap)."""
    configs = []
    for item in text.split(","):
        fields = item.split(":")
        flags = fields[3] if len(fields) == 4 else ""
        if len(fields) not in (3, 4) or not set(flags) <= {"a", "r"}:
            raise SystemExit(f"bad config {item!r}: use BLOCK_N:num_warps:num_stages, with :a for bt_ahead, "
                             f":r for a 128-register cap (:ar for both)")
        block_n, warps, stages = map(int, fields[:3])
        cfg = dict(BLOCK_M=16, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        if "a" in flags:
            cfg["bt_ahead"] = True
        if "r" in flags:
            cfg["maxnreg"] = 128
        configs.append(cfg)
    return configs


HEADS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}
GRAPH_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in
                 [(32, 2, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3),
                  (32, 2, 5), (64, 4, 5)]] + \
                [dict(BLOCK_M=16, BLOCK_N=n, num_warps=w, num_stages=s, bt_ahead=True) for n, w, s in
                 [(32, 2, 3), (32, 2, 4), (64, 4, 3)]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph-path", action="store_true")
    ap.add_argument("--models", default="llama2-7b,llama3-8b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--system", default="2048", help="shared prefix lengths (--overlap, --grid)")
    ap.add_argument("--grid", action="store_true", help="--overlap's two baselines against one-grid configs")
    ap.add_argument("--small", action="store_true", help="split counts at small batches (--batches 1,4,...)")
    ap.add_argument("--configs", default=None,
                    help="the context tiles to time, e.g. 64:4:3:a,128:8:3:a (default: the whole CONFIGS list)")
    ap.add_argument("--own", default=None,
                    help="own context lengths drawn from lo,hi (default 400,1200 with --small, else 16,800)")
    args = ap.parse_args()
    configs = parse_configs(args.configs) if args.configs else CONFIGS  # a bad list is refused before any work
    dev = torch.device("cuda")
    ceil = ceilings(dev)
    out_dir = Path(os.environ.get("OUT") or "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    gen = torch.Generator(device=dev)
    gen.seed()
    if args.small:
        lo, hi = map(int, (args.own or "400,1200").split(","))
        for name in args.models.split(","):
            for system in map(int, args.system.split(",")):
                for batch in map(int, args.batches.split(",")):
                    results += small_batch_splits(name, batch, system, lo, hi, gen, ceil)
        (out_dir / "small_batch_sweep.json").write_text(json.dumps(dict(ceilings=ceil, rows=results), indent=1,
                                                                   default=str))
        return
    if args.overlap or args.grid:
        for name in args.models.split(","):
            for system in map(int, args.system.split(",")):
                for batch in map(int, args.batches.split(",")):
                    results += overlap_variants(name, batch, system, gen, ceil, args.grid)
        name = "grid_sweep.json" if args.grid else "overlap_sweep.json"
        (out_dir / name).write_text(json.dumps(dict(ceilings=ceil, rows=results), indent=1, default=str))
        return
    for name in args.models.split(","):
        hq, hkv, d = HEADS[name]
        for batch in map(int, args.batches.split(",")):
            lo, hi = map(int, (args.own or "16,800").split(","))
            q, kc, vc, pre, meta, scale, want, _ = decode_problem(name, batch, 2048, lo, hi, gen, ceil)
            # system partials as relay computes them, so only the context kernel is timed
            s_cfg = system_config(batch * hq // hkv, d, dev, 2, hkv)
            programs = -(-batch * hq // hkv // s_cfg["BLOCK_M"]) * hkv
            splits, _ = split_plan(2048, programs, dev, s_cfg["BLOCK_N"], None, per_sm=s_cfg.get("per_sm", 1))
            o_p = torch.empty(splits, batch, hq, d, device=dev, dtype=torch.float32)
            l_p = torch.empty(splits, batch, hq, device=dev, dtype=torch.float32)
            system_attention_into(q, pre[0][0], pre[0][1], scale, o_p, l_p, rows=meta.prefix_groups[0].query_indices,
                                  num_splits=splits)
            own_bytes = int(meta.context_lens.sum()) * hkv * d * 2 * 2
            io_bytes = q.numel() * 2 * 2 + o_p.numel() * 4 + l_p.numel() * 4
            if args.graph_path:
                results += graph_path(name, batch, q, kc, vc, pre, meta, scale, want, own_bytes, ceil)
                continue
            default = paged_config(hq // hkv, d, dev, 2, hi, batch * hkv)
            for cfg in [None] + configs:
                for heads_fast in (False, True):
                    c = dict(cfg or default, heads_fast=heads_fast)
                    c.pop("per_sm", None)
                    out = torch.empty(1, batch, hq, d, device=dev, dtype=q.dtype)
                    fn = lambda: paged_attention(q, kc, vc, meta, scale, out=out, sys_part=(o_p, l_p),  # noqa
                                                 config=c)
                    try:
                        t = bench_us(fn)
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                        print(f"{name} B={batch} {c}: {type(exc).__name__}", flush=True)
                        continue
                    err = ((out[0].double() - want.double()).norm() / want.double().norm()).item()
                    gbs = (own_bytes + io_bytes) / (t * 1e-6) / 1e9
                    row = dict(case=f"{name} B={batch}", config=c, default=cfg is None, time_us=t, gb_s=gbs,
                               pct_copy=100 * gbs * 1e9 / ceil["copy_bytes_per_s"], rel_err=err)
                    results.append(row)
                    print(f"{row['case']:16s} {t:8.1f} us {gbs:7.0f} GB/s {row['pct_copy']:5.1f}% err {err:.1e} "
                          f"{'DEFAULT ' if cfg is None else ''}{c}", flush=True)
            full = bench_us(lambda: relay_attention(q, kc, vc, meta, pre, scale))
            print(f"{name} B={batch}: whole relay decode attention (default) {full:.1f} us", flush=True)
            results.append(dict(case=f"{name} B={batch}", whole_relay_us=full))
    (out_dir / "context_sweep.json").write_text(json.dumps(dict(ceilings=ceil, rows=results), indent=1, default=str))
    best = {}
    for r in results:
        if "time_us" in r and r["rel_err"] < 1e-2 and (r["case"] not in best or r["time_us"] < best[r["case"]]["time_us"]):
            best[r["case"]] = r
    for case, r in best.items():
        pct = r.get("pct_copy", r.get("pct_floor"))  # of copy bandwidth, or (--graph-path) of the floor
        print(f"BEST {case}: {r['time_us']:.1f} us {pct:.1f}% {r['config']} splits={r.get('splits')}")


def graph_path(name, batch, q, kc, vc, pre, meta, scale, want, own_bytes, ceil) -> list[dict]:
    """Whole relay decode attention as captured in a decode graph, per ctx tile x splits."""
    floor_bytes = own_bytes + pre[0][0].numel() * 2 * 2 + 2 * q.numel() * 2
    floor_us = floor_bytes / ceil["copy_bytes_per_s"] * 1e6
    rows = []
    for cfg in [None] + GRAPH_CONFIGS:
        for splits in (None, 2, 4):
            out = {}

            def fn():
                out["o"] = relay_attention_with(q, kc, vc, meta, pre, scale, ctx_config=cfg, ctx_splits=splits)
            try:
                t = bench_us(fn)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"{name} B={batch} {cfg} splits={splits}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            err = ((out["o"].double() - want.double()).norm() / want.double().norm()).item()
            row = dict(case=f"{name} B={batch} graph", config=cfg, splits=splits, time_us=t,
                       floor_us=floor_us, pct_floor=100 * floor_us / t, rel_err=err)
            rows.append(row)
            print(f"{row['case']:22s} {t:8.1f} us floor {floor_us:6.1f} us {row['pct_floor']:5.1f}% err {err:.1e} "
                  f"splits={splits} {cfg or 'DEFAULT'}", flush=True)
    return rows


def decode_problem(name, batch, system, own_lo, own_hi, gen, ceil):
    """A relay decode step (own contexts drawn from own_lo..own_hi, one shared prefix), the
    float32 reference output and the step's attention floor in microseconds."""
    dev = torch.device("cuda")
    hq, hkv, d = HEADS[name]
    q, kc, vc, pre, meta = build_step(hq, hkv, d, batch, system, own_hi, dev, torch.bfloat16, gen)
    lens = torch.randint(own_lo, own_hi + 1, (batch,), generator=gen, device=dev, dtype=torch.int32)
    meta.context_lens.copy_(lens)
    scale = d ** -0.5
    want = ref.relay_attention(q.float(), kc.float(), vc.float(), meta, [(k.float(), v.float()) for k, v in pre],
                               scale)
    own_bytes = int(lens.sum()) * hkv * d * 2 * 2
    sys_bytes = pre[0][0].numel() * 2 * 2
    floor_us = max((own_bytes + sys_bytes + 2 * q.numel() * 2) / ceil["copy_bytes_per_s"],
                   4 * batch * hq * system * d / ceil["bf16_flops_per_s"]) * 1e6
    return q, kc, vc, pre, meta, scale, want, floor_us


GRID_VARIANTS = [  # kernels/triton_relay_grid.py: tiles, stages, heads a context program takes, placement
    dict(), dict(CTX_BLOCK_N=64), dict(CTX_BLOCK_N=64, num_stages=3), dict(CTX_HEADS=2),
    dict(CTX_BLOCK_N=64, CTX_HEADS=8), dict(spread=False), dict(SYS_BLOCK_N=32, CTX_BLOCK_N=64),
    dict(CTX_BLOCK_N=64, CTX_HEADS=4, num_stages=3)]


def overlap_variants(name, batch, system, gen, ceil, grid=False) -> list[dict]:
    """The whole relay decode attention under each way of sharing the chip, and each kernel alone."""
    dev = torch.device("cuda")
    hq, hkv, d = HEADS[name]
    q, kc, vc, pre, meta, scale, want, floor_us = decode_problem(name, batch, system, 16, 800, gen, ceil)
    s_cfg = system_config(batch * hq // hkv, d, dev, 2, hkv)
    two_stages = dict(s_cfg, num_stages=2)
    variants = [("fused", dict(overlap=False)), ("context first", dict(overlap=True)),
                ("system first, priority", dict(overlap=True, system_side=True)),
                ("system first, 1 split", dict(overlap=True, system_side=True, sys_splits=1)),
                ("system first, 2 stages", dict(overlap=True, system_side=True, sys_config=two_stages)),
                ("system first, 1 split, 2 stages", dict(overlap=True, system_side=True, sys_splits=1,
                                                         sys_config=two_stages)),
                ("context first, 1 split, 2 stages", dict(overlap=True, sys_splits=1, sys_config=two_stages))]
    if grid:
        variants = variants[:2] + [(f"one grid {cfg}", dict(one_grid=True, grid_config=cfg)) for cfg in GRID_VARIANTS]
        variants.append(("one grid, 1 split", dict(one_grid=True, sys_splits=1)))
    rows = []
    case = f"{name} B={batch} S={system}"
    # each kernel alone, as relay launches it: their sum is what running them in turn costs
    programs = -(-batch * hq // hkv // s_cfg["BLOCK_M"]) * hkv
    splits, _ = split_plan(system, programs, dev, s_cfg["BLOCK_N"], None, per_sm=s_cfg.get("per_sm", 1))
    o_p = torch.empty(splits + 1, batch, hq, d, device=dev, dtype=torch.float32)
    l_p = torch.empty(splits + 1, batch, hq, device=dev, dtype=torch.float32)
    alone = {"system kernel": lambda: system_attention_into(q, pre[0][0], pre[0][1], scale, o_p[:splits], l_p[:splits],
                                                            rows=meta.prefix_groups[0].query_indices,
                                                            num_splits=splits),
             "context kernel": lambda: paged_attention(q, kc, vc, meta, scale, out=o_p, lse=l_p, split_base=splits)}
    for label, fn in alone.items():
        t = bench_us(fn)
        rows.append(dict(case=case, variant=label, time_us=t, floor_us=floor_us))
        print(f"{case:26s} {label:34s} {t:8.1f} us", flush=True)
    for label, kw in variants:
        out = {}

        def fn():
            out["o"] = relay_attention_with(q, kc, vc, meta, pre, scale, **kw)
        try:
            t = bench_us(fn)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            print(f"{case} {label}: {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        err = ((out["o"].double() - want.double()).norm() / want.double().norm()).item()
        rows.append(dict(case=case, variant=label, time_us=t, floor_us=floor_us, pct_floor=100 * floor_us / t,
                         rel_err=err))
        print(f"{case:26s} {label:60s} {t:8.1f} us floor {floor_us:6.1f} us {100 * floor_us / t:5.1f}% "
              f"err {err:.1e}", flush=True)
    return rows


SMALL_SPLITS = [(None, None), (None, 8)]


def small_batch_splits(name, batch, system, own_lo, own_hi, gen, ceil) -> list[dict]:
    """Whole relay decode attention (graphed: context on the side stream, one merge) for
    system x context split counts (None: the plan's), and each kernel alone at its plan."""
    dev = torch.device("cuda")
    hq, hkv, d = HEADS[name]
    q, kc, vc, pre, meta, scale, want, floor_us = decode_problem(name, batch, system, own_lo, own_hi, gen, ceil)
    case = f"{name} B={batch} S={system} own {own_lo}-{own_hi}"
    rows = []
    # each kernel alone: the system kernel (Gluon under capture, else Triton) per split count,
    # the context kernel into a partial, and the merge of both sides' partials
    s_cfg = system_config(batch * hq // hkv, d, dev, 2, hkv)
    programs = -(-batch * hq // hkv // s_cfg["BLOCK_M"]) * hkv
    plan, _ = split_plan(system, programs, dev, s_cfg["BLOCK_N"], None, per_sm=s_cfg.get("per_sm", 1))
    rows_idx = meta.prefix_groups[0].query_indices
    for splits in (plan,):
        o_p = torch.empty(splits + 1, batch, hq, d, device=dev, dtype=torch.float32)
        l_p = torch.empty(splits + 1, batch, hq, device=dev, dtype=torch.float32)
        for label, cfg in (("gluon", None), ("triton", dict(s_cfg, gluon=False))):
            t = bench_us(lambda: system_attention_into(q, pre[0][0], pre[0][1], scale, o_p[:splits], l_p[:splits],
                                                       rows=rows_idx, num_splits=splits, config=cfg))
            rows.append(dict(case=case, variant=f"system alone {label} splits={splits}", time_us=t))
            print(f"{case:36s} system alone {label:6s} splits {splits:3d}{' (plan)' if splits == plan else '':7s} "
                  f"{t:8.1f} us", flush=True)
        if splits == plan:
            t = bench_us(lambda: paged_attention(q, kc, vc, meta, scale, out=o_p, lse=l_p, split_base=splits))
            rows.append(dict(case=case, variant="context alone", time_us=t))
            print(f"{case:36s} context alone (one split) {t:8.1f} us", flush=True)
            t = bench_us(lambda: merge_partials(o_p, l_p, q.dtype, with_lse=False))
            rows.append(dict(case=case, variant="merge alone", time_us=t))
            print(f"{case:36s} merge alone ({splits + 1} partials) {t:8.1f} us", flush=True)
    for splits in (None, 4, 8, 16):  # the --no-relay kernel: each request reads the prefix itself
        out = {}

        def fn_b():
            out["o"] = prefix_paged_attention(q, kc, vc, meta, pre, scale, num_splits=splits)
        t = bench_us(fn_b)
        err = ((out["o"].double() - want.double()).norm() / want.double().norm()).item()
        rows.append(dict(case=case, variant=f"baseline splits={splits}", time_us=t, floor_us=floor_us, rel_err=err))
        print(f"{case:36s} whole, baseline splits {str(splits):5s} {t:8.1f} us err {err:.1e}", flush=True)
    for label, kw in (("fused", dict(overlap=False)), ("one grid", dict(one_grid=True))):
        out = {}

        def fn_v():
            out["o"] = relay_attention_with(q, kc, vc, meta, pre, scale, **kw)
        t = bench_us(fn_v)
        err = ((out["o"].double() - want.double()).norm() / want.double().norm()).item()
        rows.append(dict(case=case, variant=label, time_us=t, floor_us=floor_us, rel_err=err))
        print(f"{case:36s} whole, {label:22s} {t:8.1f} us err {err:.1e}", flush=True)
    for sys_splits, ctx_splits in SMALL_SPLITS:
        out = {}

        def fn():
            out["o"] = relay_attention_with(q, kc, vc, meta, pre, scale, sys_splits=sys_splits,
                                            ctx_splits=ctx_splits)
        try:
            t = bench_us(fn)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
            print(f"{case} {sys_splits}/{ctx_splits}: {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        err = ((out["o"].double() - want.double()).norm() / want.double().norm()).item()
        rows.append(dict(case=case, sys_splits=sys_splits, ctx_splits=ctx_splits, time_us=t, floor_us=floor_us,
                         pct_floor=100 * floor_us / t, rel_err=err))
        print(f"{case:36s} splits system {str(sys_splits):4s} context {str(ctx_splits):4s} {t:8.1f} us "
              f"floor {floor_us:6.1f} us {100 * floor_us / t:5.1f}% err {err:.1e}", flush=True)
    # kernel durations inside the default graph (the two streams' kernels may overlap)
    graph = torch.cuda.CUDAGraph()
    relay_attention_with(q, kc, vc, meta, pre, scale)
    with torch.cuda.graph(graph):
        relay_attention_with(q, kc, vc, meta, pre, scale)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", 0.0)
        if total > 0 and ev.count:
            print(f"{case:36s} in graph: {ev.key[:40]:40s} {ev.count // 20:3d}x {total / ev.count:8.1f} us", flush=True)
    return rows


if __name__ == "__main__":
    main()

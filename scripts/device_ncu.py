#!/usr/bin/env python
"""One attention launch of a decode step, repeated, for Nsight Compute (or timed alone).

Run under `ncu --kernel-name ... --launch-skip K --launch-count 1` (scripts/device_ncu.sh)
to read what one launch spends its cycles on; with --time, prints the graph-replayed
median of the same launch (L2 flushed), so ncu's duration can be set beside it.

Kernels (--what): sys (the system kernel, Gluon on Hopper as the engine's decode graphs
run it, fp32 partials), ctx (the paged context kernel writing a partial, as in the
overlap path), merge (the merge of system + context partials), relay (all three, the
graphed decode step's attention).

Usage: python scripts/device_ncu.py --what sys --model llama3-8b --batch 256 --system 2048
       [--own 300] [--splits N] [--stages 3] [--block-n 64] [--maxnreg R] [--system-side | --context-first]
       [--pdl] [--no-ws | --ws] [--bucket N] [--time] [--repeat 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels.triton_context_attention import context_splits, paged_attention, paged_config  # noqa: E402
from kernels.triton_ops import relay_attention_with  # noqa: E402
from kernels.triton_plan import DECODE_TILE, WS_TILE, split_plan, system_config  # noqa: E402
from kernels.triton_system_attention import merge_partials, system_attention_into  # noqa: E402
from relaycli.bench.kernels import build_step  # noqa: E402

HEADS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}


def make_case(args):
    """Inputs and a closure that runs the chosen launch(es) once."""
    hq, hkv, d = HEADS[args.model]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.seed()
    q, k_cache, v_cache, prefixes, meta = build_step(hq, hkv, d, args.batch, args.system, args.own, dev,
                                                     torch.bfloat16, gen)
    if args.bucket:  # plan the step for this context bucket's bound, as decode graphs did before the
        # seventeenth session (they now price their rows' real keys); the rows keep their keys
        assert args.bucket >= args.own, "a bucket holds the step's longest own context"
        meta = dataclasses.replace(meta, max_context_len=args.bucket, _cache={})
    k_sys, v_sys = prefixes[0]
    scale = d ** -0.5
    rows = meta.prefix_groups[0].query_indices
    cfg = dict(DECODE_TILE if args.no_ws else system_config(args.batch * hq // hkv, d, dev, 2, hkv))
    cfg.update(gluon=not args.triton, tma=True)
    if args.stages:
        cfg["num_stages"] = args.stages
    if args.block_n:
        cfg["BLOCK_N"] = args.block_n
    programs = triton.cdiv(args.batch * hq // hkv, cfg["BLOCK_M"]) * hkv
    splits, _ = split_plan(args.system, programs, dev, cfg["BLOCK_N"], args.splits, per_sm=cfg.get("per_sm", 1))
    c_splits = context_splits(meta, q, hkv, 0, None, None, read_ahead=True)
    o_part = torch.empty(splits + c_splits, args.batch, hq, d, dtype=torch.float32, device=dev)
    lse_part = torch.empty(splits + c_splits, args.batch, hq, dtype=torch.float32, device=dev)
    print(f"case {args.what} {args.model} B={args.batch} S={args.system} own={args.own}: "
          f"system splits {splits} ({programs} row tiles x heads), context splits {c_splits}, cfg {cfg}", flush=True)

    def sys_step():
        system_attention_into(q, k_sys, v_sys, scale, o_part[:splits], lse_part[:splits], rows=rows,
                              num_splits=splits, config=dict(cfg))

    ctx_cfg = None
    if args.maxnreg is not None:  # the tile paged_attention would pick, with this register cap (0: none)
        ctx_cfg = dict(paged_config(meta.max_seqlen_q * hq // hkv, d, dev, 2, -(-meta.max_context_len // c_splits),
                                    meta.num_seqs * hkv), maxnreg=args.maxnreg or None)
        print(f"context config {ctx_cfg}", flush=True)

    def ctx_step():
        paged_attention(q, k_cache, v_cache, meta, scale, out=o_part, lse=lse_part, split_base=splits,
                        num_splits=c_splits, read_ahead=True, config=ctx_cfg)

    def merge_step():
        merge_partials(o_part, lse_part, q.dtype, with_lse=False)

    order = dict(system_side=False, resident=False) if args.context_first else \
        dict(system_side=True) if args.system_side else {}
    if args.pdl:
        order["pdl"] = True

    sys_tile = dict(DECODE_TILE) if args.no_ws else dict(WS_TILE) if args.ws else None
    if args.ws:  # the warp-specialised tile at its own split plan, even where the plan would run it beside
        order["resident"] = False

    def relay_step():  # --splits, --system-side/--context-first, --maxnreg, --no-ws/--ws reach the relay call too
        relay_attention_with(q, k_cache, v_cache, meta, prefixes, scale, sys_splits=args.splits, ctx_config=ctx_cfg,
                             sys_config=sys_tile, **order)

    return dict(sys=sys_step, ctx=ctx_step, merge=merge_step, relay=relay_step)[args.what]


def graph_us(fn) -> float:
    """Median of do_bench (L2 flushed) over replays of a CUDA graph of fn."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", choices=["sys", "ctx", "merge", "relay"], default="sys")
    p.add_argument("--model", choices=sorted(HEADS), default="llama3-8b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--system", type=int, default=2048)
    p.add_argument("--own", type=int, default=300)
    p.add_argument("--splits", type=int, default=None)
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--maxnreg", type=int, default=None, help="register cap of the context kernel (ctx; 0: none)")
    p.add_argument("--system-side", action="store_true", help="relay: the system kernel first (the plan's order)")
    p.add_argument("--context-first", action="store_true",
                   help="relay: the context kernel first, the system split for two programs an SM (before s13)")
    p.add_argument("--pdl", action="store_true",
                   help="relay: one stream, the context kernel a programmatic dependent of the system kernel")
    p.add_argument("--triton", action="store_true", help="the Triton system kernel instead of Gluon")
    p.add_argument("--no-ws", action="store_true",
                   help="the 64-row decode system tile, not the warp-specialised one where it pays")
    p.add_argument("--ws", action="store_true",
                   help="relay: the warp-specialised system tile at its own split plan (Hopper)")
    p.add_argument("--bucket", type=int, default=None,
                   help="relay/ctx: plan for this context bucket's bound (>= --own), not the real own keys")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--time", action="store_true")
    args = p.parse_args()
    fn = make_case(args)
    if args.time:
        print(f"time {args.what} {args.model} B={args.batch} S={args.system} own={args.own} "
              f"splits={args.splits} stages={args.stages} block_n={args.block_n} maxnreg={args.maxnreg} "
              f"system_side={args.system_side} context_first={args.context_first} pdl={args.pdl} "
              f"ws={args.ws} no_ws={args.no_ws} bucket={args.bucket}: "
              f"{graph_us(fn):.1f} us", flush=True)
        return
    for _ in range(args.repeat):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

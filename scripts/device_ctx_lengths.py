"""Probe: the context step of a decode batch whose rows have unequal own lengths, as in a job.

In a bench job (ShareGPT-like lengths, batch 193-256) the paged context kernel took about
1.4x its time at equal lengths of the same mean. This times, graph-replayed with L2
flushed, the context kernel alone and the whole relay attention of one decode step at
the same rows' total keys, for the rows
  uniform            every row the mean length, under the mean's context bucket;
  uniform@bucket     the same, under the longest row's bucket (what sizes a graph's plan);
  random             ShareGPT-like lengths (each row a request part-way through its
                     output) in random order, under the longest row's bucket;
  longest-first      the same rows longest first (the scheduler's order: the block
                     scheduler starts the grid in row order);
  longest-first@max  the same, max_context_len the longest row instead of its bucket;
with the context tile paged_config picks (auto: by the keys a split, from
max_context_len), its short tile (32 keys, as for <= 512 keys) and its long tile (64
keys), and the split count of the plan or 2.

    python scripts/device_ctx_lengths.py --model llama3-8b --batch 256 --system 2048 --out $OUT/ctx_lengths.log
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels.triton_context_attention import context_splits, paged_attention, paged_config  # noqa: E402
from kernels.triton_ops import relay_attention_with  # noqa: E402
from kernels.triton_plan import system_config  # noqa: E402
from relaycli.bench.kernels import build_step  # noqa: E402
from relaycli.bench.workloads import get_workload, make_requests  # noqa: E402
from relaycli.engine.cuda_graph import context_bucket  # noqa: E402
from scripts.device_ncu import HEADS, graph_us  # noqa: E402


def job_lengths(batch: int, seed: int) -> list[int]:
    """Own keys of a batch in a job's steady state: input plus a uniform part of the output."""
    rng = random.Random(seed)
    shapes = make_requests(get_workload("sharegpt"), batch, seed)
    return [s.input_len + rng.randint(1, s.output_len) for s in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(HEADS), default="llama3-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--splits", default="plan,2")
    ap.add_argument("--tiles", default="auto,short,long")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--pdl", action="store_true", help="also relay attention with pdl=True beside each row")
    ap.add_argument("--sys-tiles", default="", help="system tiles BLOCK_N:stages to try beside each row, e.g. 32:3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hq, hkv, d = HEADS[args.model]
    dev = torch.device("cuda")
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    for seed in (int(s) for s in args.seeds.split(",")):
        lens = job_lengths(args.batch, seed)
        mean = round(statistics.mean(lens))
        say(f"seed {seed}: {args.model} B={args.batch} S={args.system}, own keys mean {mean}, "
            f"median {statistics.median(lens):.0f}, max {max(lens)}, bucket {context_bucket(max(lens))}")
        longest, top = sorted(lens, reverse=True), context_bucket(max(lens))
        cases = {"uniform": ([mean] * args.batch, context_bucket(mean)), "uniform@bucket": ([mean] * args.batch, top),
                 "random": (lens, top), "longest-first": (longest, top), "longest-first@max": (longest, max(lens))}
        for name, (rows, max_len) in cases.items():
            if args.cases and name not in args.cases.split(","):
                continue
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)
            q, kc, vc, pre, meta = build_step(hq, hkv, d, args.batch, args.system, 0, dev, torch.bfloat16, gen,
                                              lens=rows, max_context_len=max_len)
            scale = d ** -0.5
            gbytes = sum(rows) * hkv * d * 2 * q.element_size() / 1e9
            ref = None
            for tile in args.tiles.split(","):
                for sp in args.splits.split(","):
                    forced = None if sp == "plan" else int(sp)
                    c = context_splits(meta, q, hkv, 0, forced, None, read_ahead=True)
                    # the tile paged_config picks for this many keys a split: "short" as for <= 512
                    keys = {"auto": -(-max_len // c), "short": 1, "long": 1 << 20}[tile]
                    cfg = paged_config(hq // hkv, d, dev, 2, keys, args.batch * hkv)
                    o = torch.empty(c, args.batch, hq, d, dtype=torch.float32, device=dev)
                    lse = torch.empty(c, args.batch, hq, dtype=torch.float32, device=dev)
                    ctx_us = graph_us(lambda: paged_attention(q, kc, vc, meta, scale, out=o, lse=lse, num_splits=c,
                                                              config=cfg))
                    relay = lambda: relay_attention_with(q, kc, vc, meta, pre, scale, ctx_splits=forced,  # noqa: E731
                                                         ctx_config=cfg)
                    out = relay()
                    ref = out if ref is None else ref
                    err = (out.float() - ref.float()).abs().max().item()
                    relay_us = graph_us(relay)
                    say(f"  {name:17s} tile {tile:5s} BLOCK_N {cfg['BLOCK_N']:2d} ctx splits {c} ({sp:4s}): "
                        f"context kernel {ctx_us:7.1f} us ({gbytes / ctx_us * 1e3:5.2f} TB/s)  "
                        f"relay attention {relay_us:7.1f} us  max diff vs the first {err:.1e}")
                    if args.pdl:  # one stream: the context kernel a programmatic dependent of the system kernel
                        pdl = lambda: relay_attention_with(q, kc, vc, meta, pre, scale, ctx_splits=forced,  # noqa: E731
                                                           ctx_config=cfg, pdl=True)
                        err = (pdl().float() - ref.float()).abs().max().item()
                        say(f"    pdl: relay attention {graph_us(pdl):7.1f} us  max diff vs the first {err:.1e}")
                    for tiles in filter(None, args.sys_tiles.split(",")):
                        # the system kernel's key tile and stages: less shared memory a program
                        # leaves more room for the context programs beside it
                        block_n, stages = (int(x) for x in tiles.split(":"))
                        sys_cfg = dict(system_config(args.batch * hq // hkv, d, dev, 2, hkv), BLOCK_N=block_n,
                                       num_stages=stages)
                        sys_relay = lambda: relay_attention_with(q, kc, vc, meta, pre, scale,  # noqa: E731
                                                                 ctx_splits=forced, ctx_config=cfg,
                                                                 sys_config=sys_cfg)
                        err = (sys_relay().float() - ref.float()).abs().max().item()
                        say(f"    system tile BLOCK_N {block_n:3d} stages {stages}: relay attention "
                            f"{graph_us(sys_relay):7.1f} us  max diff vs the first {err:.1e}")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Where the Gluon system kernel's fixed cost goes: time against key tiles a program.

For each batch, the grid is fixed (row tiles x KV heads x --splits programs) and the
prefix grows so that each program walks T key tiles (T in --tiles). A straight line
through (T, time) gives the cost a tile (slope) and the cost every program pays once
(intercept). Beside it, an empty kernel on the same grid gives the launch's own cost.
Each --variant NAME=PATH (a copy of kernels/gluon_system_attention.py from another
commit, or one with a part taken out to see what it costs) runs on the same inputs,
alternating with the current kernel; the table says whether it wrote the same bits.

Times: median of triton do_bench (L2 flushed) over replays of a CUDA graph of one launch.

Usage: python scripts/device_sys_probe.py [--variant NAME=PATH ...] [--batches 64,256] [--tiles 1,2,4,8,16,32]
       [--splits 8] [--model llama3-8b] [--bf16-partials]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import gluon_system_attention as current  # noqa: E402
from scripts.device_ncu import graph_us  # noqa: E402

HEADS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}
BLOCK_M = BLOCK_N = 64


@triton.jit
def _empty_kernel(x_ptr):
    """Nothing: the grid's launch and drain alone."""
    if tl.program_id(0) < 0:
        tl.store(x_ptr, 0.0)


def load_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"gluon_system_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", default=[], metavar="NAME=PATH",
                   help="another version of gluon_system_attention.py (repeatable)")
    p.add_argument("--model", choices=sorted(HEADS), default="llama3-8b")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--tiles", default="1,2,4,8,16,32")
    p.add_argument("--splits", type=int, default=None, help="default: 8 at batch 64, 2 at 256 (the plan's)")
    p.add_argument("--bf16-partials", action="store_true", help="add the current kernel with bf16 o partials")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    hq, hkv, d = HEADS[args.model]
    dev = torch.device("cuda")
    variants = {"current": current}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        variants[name] = load_module(name, path)
    part_dtype = dict.fromkeys(variants, torch.float32)
    if args.bf16_partials:  # the current kernel writing its o partials in bf16: half the bytes
        variants["bf16-part"] = current
        part_dtype["bf16-part"] = torch.bfloat16
    scale = d ** -0.5
    for batch in (int(b) for b in args.batches.split(",")):
        splits = args.splits or (8 if batch <= 64 else 2)
        row_tiles = triton.cdiv(batch * hq // hkv, BLOCK_M)
        grid = (row_tiles, hkv, splits)
        dummy = torch.empty(1, device=dev)
        empty = graph_us(lambda: _empty_kernel[grid](dummy))
        print(f"{args.model} B={batch} splits={splits} grid={grid} ({row_tiles * hkv * splits} programs): "
              f"empty kernel {empty:.1f} us", flush=True)
        times: dict[str, dict[int, list[float]]] = {name: {} for name in variants}
        tiles = [int(t) for t in args.tiles.split(",")]
        for t in tiles:
            seq = t * BLOCK_N * splits
            q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(seq, hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(seq, hkv, d, device=dev, dtype=torch.bfloat16)
            rows = torch.arange(batch, device=dev)
            outs = {}
            for name, mod in variants.items():
                o = torch.empty(splits, batch, hq, d, device=dev, dtype=part_dtype[name])
                lse = torch.empty(splits, batch, hq, device=dev, dtype=torch.float32)

                def run(mod=mod, o=o, lse=lse):
                    mod.gluon_system_attention_into(q, k, v, scale, o, lse, rows, splits, BLOCK_M, BLOCK_N, 3)

                run()
                torch.cuda.synchronize()
                outs[name] = (o.clone(), lse.clone(), run)
            same = ",".join(n for n in outs if n != "current" and torch.equal(outs[n][0], outs["current"][0])
                            and torch.equal(outs[n][1], outs["current"][1])) or "none"
            for _ in range(args.rounds):
                for name in variants:
                    times[name].setdefault(t, []).append(graph_us(outs[name][2]))
            line = "  ".join(f"{name} {statistics.median(times[name][t]):6.1f}" for name in variants)
            print(f"  T={t:3d} tiles (S={seq:6d}): {line} us  same bits as current: {same}", flush=True)
        for name in variants:
            slope, icpt = fit(tiles, [statistics.median(times[name][t]) for t in tiles])
            print(f"  {name}: {slope:.3f} us a tile, {icpt:.1f} us fixed ({icpt - empty:.1f} over the empty kernel)",
                  flush=True)


if __name__ == "__main__":
    main()

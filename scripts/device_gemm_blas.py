"""Probe: a decode step's weight products under torch's BLAS choices, at engine batch sizes.

A llama3-8b decode step at batch 193-256 is bound by its products' matrix work, and
cuBLAS's default heuristic picks one algorithm a shape. This times each product of a
layer (qkv, o, gate_up, down) and the lm_head, graph-replayed with L2 flushed, three ways:
  cublas     torch's default library choice;
  cublaslt   torch.backends.cuda.preferred_blas_library("cublaslt");
  tunable    TunableOp, tuned here on these shapes (every algorithm it can enumerate timed).
Each result is checked against the default's output (bf16 rounding: split-K and tile
orders may differ).

    python scripts/device_gemm_blas.py --batches 64,128,256 --out $OUT/gemm_blas.log
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.device_ncu import graph_us  # noqa: E402

# (name, out features, in features) of llama3-8b's products
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = {n: torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02 for n, o, i in SHAPES}
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    rate = 2 * 8192 ** 3 / (graph_us(lambda: a @ a) * 1e-6)
    say(f"matmul ceiling (8192^3, default library): {rate / 1e12:.0f} TFLOP/s")
    del a
    batches = [int(b) for b in args.batches.split(",")]
    xs = {m: {n: torch.randn(m, i, device=dev, dtype=torch.bfloat16) for n, _, i in SHAPES} for m in batches}
    results = {}
    for mode in ("cublas", "cublaslt", "tunable"):
        if mode == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        if mode == "tunable":
            torch.backends.cuda.preferred_blas_library("cublas")
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            torch.cuda.tunable.set_filename(str(Path(args.out).with_suffix(".tunable.csv")) if args.out
                                            else "tunable.csv")
            torch.cuda.tunable.set_max_tuning_iterations(30)
            for m in batches:  # tune outside any graph capture
                for n, _, _ in SHAPES:
                    F.linear(xs[m][n], weights[n])
            torch.cuda.synchronize()
            torch.cuda.tunable.tuning_enable(False)
        for m in batches:
            for n, o, i in SHAPES:
                x, w = xs[m][n], weights[n]
                y = F.linear(x, w)
                us = graph_us(lambda: F.linear(x, w))
                ref = results.get(("cublas", m, n))
                err = 0.0 if ref is None else ((y.float() - ref[1].float()).abs().max() /
                                               ref[1].float().abs().max()).item()
                results[(mode, m, n)] = (us, y)
                floor_us = max(2 * m * o * i / rate, 2 * o * i / 4.1e12) * 1e6
                base = results[("cublas", m, n)][0]
                say(f"{mode:9s} M={m:4d} {n:8s} {us:8.1f} us  {floor_us / us * 100:5.1f}% of floor "
                    f"({floor_us:6.1f} us)  x{base / us:.3f} vs cublas  max rel err {err:.1e}")
    for m in batches:
        tot = {mode: sum(results[(mode, m, n)][0] * (32 if n != "lm_head" else 1) for n, _, _ in SHAPES)
               for mode in ("cublas", "cublaslt", "tunable")}
        say(f"M={m:4d} a step's products (32 layers + lm_head): " +
            "  ".join(f"{k} {v / 1e3:.3f} ms" for k, v in tot.items()))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

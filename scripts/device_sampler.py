"""The sampler on a GPU: what a decode step's token choice costs, and that it never waits.

Times Sampler.sample_tensor on [B, V] fp32 logits for greedy rows, temperature-only rows
and top-p/top-k rows, with the Triton kernel and with the PyTorch path (GPU time: median
of CUDA-event timings; host time: queueing the calls), the full sort the PyTorch top-p
path pays, and checks with torch.cuda.set_sync_debug_mode("error") that no path reads
back to the host (a read-back would stall the engine's overlapped steps). --sweep also
times the kernels' block size, probes per pass, warps, scratch width and draw chunk on
three kinds of logits, checking each configuration's tokens against the default's.
Usage: python scripts/device_sampler.py [--batch 256] [--vocab 128256] [--sweep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from relaycli.engine.sampler import Sampler  # noqa: E402
from relaycli.engine.sequence import SamplingOptions  # noqa: E402


def gpu_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    logits = torch.randn(args.batch, args.vocab, device=dev) * 3
    cases = {"greedy": SamplingOptions(max_tokens=1),
             "temperature 0.8": SamplingOptions(max_tokens=1, temperature=0.8, seed=1),
             "temperature 0.7, top_p 0.9": SamplingOptions(max_tokens=1, temperature=0.7, top_p=0.9, seed=1),
             "temperature 1.0, top_k 40": SamplingOptions(max_tokens=1, temperature=1.0, top_k=40, seed=1)}
    draws = list(range(args.batch))
    for (label, opt), kernel in [(case, kernel) for case in cases.items() for kernel in Sampler.KERNELS]:
        if kernel == "torch" and opt.is_greedy:
            continue  # the same argmax either way
        sampler = Sampler(dev, kernel)
        opts = [opt] * args.batch
        ms = gpu_ms(lambda: sampler.sample_tensor(logits, opts, draws))
        host = []
        for _ in range(10):  # host time of queueing the work, the GPU left to run behind it
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sampler.sample_tensor(logits, opts, draws)
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.set_sync_debug_mode("error")  # any read-back raises from here on
        try:
            sampler.sample_tensor(logits, opts, draws)
            syncs = "none"
        except RuntimeError as exc:
            syncs = f"SYNC: {exc}"[:120]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"B={args.batch} V={args.vocab} {label:28s} {kernel:6s} GPU {ms:7.3f} ms  host {statistics.median(host):7.3f} ms  "
              f"host syncs: {syncs}", flush=True)
    print(f"torch.sort of [{args.batch}, {args.vocab}] fp32: {gpu_ms(lambda: torch.sort(logits, dim=-1)):.3f} ms; "
          f"torch.topk 1024: {gpu_ms(lambda: torch.topk(logits, 1024, dim=-1)):.3f} ms", flush=True)
    if args.sweep:
        from kernels import triton_sampler
        vocab = args.vocab
        peaked = torch.randn(args.batch, vocab, device=dev)
        peaked.scatter_add_(1, torch.randint(0, vocab, (args.batch, 30), device=dev),
                            torch.full((args.batch, 30), 10.0, device=dev))
        kinds = {"randn*3": logits, "peaked (LM-like)": peaked,
                 "flat (random weights)": torch.randn(args.batch, vocab, device=dev) * 0.05}
        for (label, opt), (kind, rows) in [(c, k) for c in cases.items() for k in kinds.items()]:
            if opt.is_greedy:
                continue
            params = triton_sampler.pack_params([opt.seed + d for d in draws], [min(opt.top_k or vocab, vocab)] * args.batch,
                                                [opt.temperature] * args.batch, [opt.top_p] * args.batch).to(dev)
            want = triton_sampler.sample(rows, params)
            for block, probes, warps, width, chunk in [(1024, 8, 4, 4096, 8192), (1024, 8, 4, 4096, 4096),
                                                       (1024, 8, 4, 4096, 16384), (2048, 8, 8, 4096, 8192),
                                                       (512, 8, 4, 4096, 8192), (1024, 8, 4, 16384, 8192)]:
                scratch = torch.empty(args.batch, width, device=dev)
                config = dict(scratch=scratch, block=block, probes=probes, num_warps=warps, chunk=chunk)
                got = triton_sampler.sample(rows, params, **config)
                ms = gpu_ms(lambda: triton_sampler.sample(rows, params, **config))
                print(f"sweep {label:28s} {kind:22s} block {block:5d} probes {probes:2d} warps {warps:2d} "
                      f"scratch {width:5d} chunk {chunk:5d}: {ms:7.3f} ms  same tokens: {bool(torch.equal(got, want))}",
                      flush=True)


if __name__ == "__main__":
    main()

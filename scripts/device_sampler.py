"""The sampler on a GPU: what a decode step's token choice costs, and that it never waits.

Times Sampler.sample_tensor on [B, V] fp32 logits for greedy rows, temperature-only rows
and top-p/top-k rows (GPU time: median of CUDA-event timings; host time: queueing the
calls), the full sort the top-p path pays, and
checks with torch.cuda.set_sync_debug_mode("error") that no path reads back to the host
(a read-back would stall the engine's overlapped steps).
Usage: python scripts/device_sampler.py [--batch 256] [--vocab 128256]
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
    args = ap.parse_args()
    dev = torch.device("cuda")
    logits = torch.randn(args.batch, args.vocab, device=dev) * 3
    cases = {"greedy": SamplingOptions(max_tokens=1),
             "temperature 0.8": SamplingOptions(max_tokens=1, temperature=0.8, seed=1),
             "temperature 0.7, top_p 0.9": SamplingOptions(max_tokens=1, temperature=0.7, top_p=0.9, seed=1),
             "temperature 1.0, top_k 40": SamplingOptions(max_tokens=1, temperature=1.0, top_k=40, seed=1)}
    ids = list(range(args.batch))
    for label, opt in cases.items():
        sampler = Sampler(dev)
        opts = [opt] * args.batch
        ms = gpu_ms(lambda: sampler.sample_tensor(logits, ids, opts))
        host = []
        for _ in range(10):  # host time of queueing the work, the GPU left to run behind it
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sampler.sample_tensor(logits, ids, opts)
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.set_sync_debug_mode("error")  # any read-back raises from here on
        try:
            sampler.sample_tensor(logits, ids, opts)
            syncs = "none"
        except RuntimeError as exc:
            syncs = f"SYNC: {exc}"[:120]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"B={args.batch} V={args.vocab} {label:28s} GPU {ms:7.3f} ms  host {statistics.median(host):7.3f} ms  "
              f"host syncs: {syncs}", flush=True)
    print(f"torch.sort of [{args.batch}, {args.vocab}] fp32: {gpu_ms(lambda: torch.sort(logits, dim=-1)):.3f} ms; "
          f"torch.topk 1024: {gpu_ms(lambda: torch.topk(logits, 1024, dim=-1)):.3f} ms", flush=True)


if __name__ == "__main__":
    main()

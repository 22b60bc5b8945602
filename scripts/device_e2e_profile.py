"""Where the decode steps of a real `relay bench e2e` run go, on the GPU and between.

Runs the bench workload (ShareGPT-like lengths, a shared system prompt, ignore_eos) on
one engine, warmed up as relay bench warms up, and profiles a window of decode steps
in the middle of the run with torch.profiler. Prints the kernels by GPU time, and how
much of the window's wall time the GPU was busy: a busy fraction well below 1 means the
host (or a wait) sets the pace, not the kernels.
Usage: python scripts/device_e2e_profile.py [--preset llama3-8b] [--system 2048] [--skip 300] [--steps 20]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models.registry import load_model  # noqa: E402
from relaycli.bench.workloads import get_workload, make_requests  # noqa: E402
from relaycli.compile import prefix_from_ids  # noqa: E402
from relaycli.config import EngineConfig  # noqa: E402
from relaycli.engine.engine import Engine, TokenRequest, frozen_heap  # noqa: E402
from relaycli.engine.sequence import SamplingOptions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--relay", type=int, default=1)
    ap.add_argument("--skip", type=int, default=300, help="engine steps before the window")
    ap.add_argument("--steps", type=int, default=20, help="engine steps profiled")
    args = ap.parse_args()
    shapes = make_requests(get_workload("sharegpt"), args.requests, 0)
    lm = load_model(f"dummy:{args.preset}", dtype="bfloat16", device="cuda")
    lm.config.max_position_embeddings = max(lm.config.max_position_embeddings,
                                            args.system + max(r.input_len + r.output_len for r in shapes))
    rng = random.Random(1)
    vocab = lm.config.vocab_size
    sys_ids = [rng.randrange(vocab) for _ in range(args.system)]
    prefix = prefix_from_ids(lm, sys_ids, "bench")

    def requests(cap=None, count=None):
        return [TokenRequest(i, str(i), sys_ids + [rng.randrange(vocab) for _ in range(r.input_len)],
                             SamplingOptions(max_tokens=min(r.output_len, cap or r.output_len), ignore_eos=True),
                             prefix_slot=0) for i, r in enumerate(shapes[:count])]

    eng = Engine(lm, [prefix], EngineConfig(max_num_seqs=args.batch, relay=bool(args.relay)))
    sum(1 for _ in eng.generate_tokens(requests(128, args.batch)))
    eng.runner.graphs.capture_all(args.batch, max(r.input_len + r.output_len for r in shapes), [0])
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=args.skip, warmup=2, active=args.steps, repeat=1))
    window = {}

    def on_step(stats):
        n = stats.prefill_steps + stats.decode_steps
        if n == args.skip + 2:
            torch.cuda.synchronize()
            window["t0"], window["steps0"] = time.perf_counter(), (stats.prefill_steps, stats.decode_steps)
        if n == args.skip + 2 + args.steps:
            torch.cuda.synchronize()
            window["t1"], window["steps1"] = time.perf_counter(), (stats.prefill_steps, stats.decode_steps)
            window["log"] = stats.decode_step_log[window["steps0"][1]:]
        prof.step()

    with frozen_heap(), prof:
        sum(1 for _ in eng.generate_tokens(requests(), on_step))
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy_us, end = 0.0, float("-inf")
    for a, b in spans:  # the union of kernel intervals: two streams may overlap
        if b > end:
            busy_us += b - max(a, end)
            end = b
    first, last = (spans[0][0], max(b for _, b in spans)) if spans else (0.0, 0.0)
    wall = window["t1"] - window["t0"]
    (p0, d0), (p1, d1) = window["steps0"], window["steps1"]
    print(f"window: {d1 - d0} decode + {p1 - p0} prefill steps, wall {wall * 1e3:.1f} ms, "
          f"{wall * 1e3 / max(1, (d1 - d0) + (p1 - p0)):.2f} ms a step; GPU busy {busy_us / 1e3:.1f} ms of the "
          f"{(last - first) / 1e3:.1f} ms from first kernel to last ({busy_us / max(last - first, 1e-9):.2f})")
    log = window["log"]
    if log:  # the shapes of the window's decode steps, to time the same shape alone
        seqs = [n for n, _, _ in log]
        print(f"window decode steps: batch {min(seqs)}-{max(seqs)}, "
              f"own keys a row {sum(c for _, c, _ in log) / sum(seqs):.0f} on average")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))


if __name__ == "__main__":
    main()

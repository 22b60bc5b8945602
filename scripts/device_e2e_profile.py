"""Where the decode steps of a real `relay bench e2e` run go, on the GPU and between.

Runs the bench workload (ShareGPT-like lengths, a shared system prompt, ignore_eos) on
one engine, warmed up as relay bench warms up, and profiles a window of decode steps
in the middle of the run with torch.profiler. Prints the kernels by GPU time, and how
much of the window's wall time the GPU was busy: a busy fraction well below 1 means the
host (or a wait) sets the pace, not the kernels.
Usage: python scripts/device_e2e_profile.py [--preset llama3-8b] [--system 2048] [--skip 300] [--steps 20]
       [--after-prefill] [--replay N]
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


def replay_alone(eng, count: int) -> tuple[int, tuple, float]:
    """Replay the graph of the step in flight `count` times back to back, nothing between,
    and return (batch, key, median microseconds a replay). Its buffers still hold that
    step's inputs, so each replay writes the same k/v to the same slots and the same logits."""
    assert eng._pending is not None and not eng._pending.is_prefill, "the step in flight must be a decode step"
    seqs = eng._pending.seqs
    graphs = eng.runner.graphs
    key = graphs.key(seqs)
    graph = graphs.graphs[key]
    times = []
    for _ in range(count):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    us = sorted(a.elapsed_time(b) * 1e3 for a, b in times)
    return len(seqs), key, us[len(us) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--relay", type=int, default=1)
    ap.add_argument("--skip", type=int, default=300, help="engine steps before the window")
    ap.add_argument("--steps", type=int, default=20, help="engine steps profiled")
    ap.add_argument("--replay", type=int, default=0,
                    help="no profiler: time this many back-to-back replays of the step's graph at the window's "
                         "start against the job's own step times after it")
    ap.add_argument("--after-prefill", action="store_true",
                    help="start the window two decode steps after the first prefill past --skip")
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
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    window = {"last_prefill": (0, 0)}

    def on_step(stats):
        n = stats.prefill_steps + stats.decode_steps
        if stats.prefill_steps != window["last_prefill"][0]:
            window["last_prefill"] = (stats.prefill_steps, stats.decode_steps)
        if "t0" not in window:
            # --after-prefill: start two decode steps after a prefill round, so the window
            # holds decode steps alone until the next round
            settled = not args.after_prefill or (window["last_prefill"][0] > 0 and n > args.skip and
                                                 stats.decode_steps - window["last_prefill"][1] == 2)
            if n >= args.skip + 2 and settled:
                torch.cuda.synchronize()
                if args.replay:
                    window["replay"] = replay_alone(eng, args.replay)
                window["t0"], window["steps0"], window["n0"] = (time.perf_counter(),
                                                                (stats.prefill_steps, stats.decode_steps), n)
                if not args.replay:
                    prof.start()
        elif "t1" not in window and n == window["n0"] + args.steps:
            torch.cuda.synchronize()
            if not args.replay:
                prof.stop()
            window["t1"], window["steps1"] = time.perf_counter(), (stats.prefill_steps, stats.decode_steps)
            window["log"] = stats.decode_step_log[window["steps0"][1]:]

    with frozen_heap():
        sum(1 for _ in eng.generate_tokens(requests(), on_step))
    if args.replay:
        if "log" not in window:
            raise SystemExit(f"the job ended before a window of {args.steps} steps past --skip {args.skip}")
        log = window["log"][1:]  # the first step's time holds the replays
        times = sorted(t for _, _, t in log)
        bs, key, us = window["replay"]
        print(f"decode graph {key} (batch {bs}) replayed alone, back to back: {us / 1e3:.2f} ms a replay (median); "
              f"the job's next {len(log)} decode steps (batch {min(b for b, _, _ in log)}-{max(b for b, _, _ in log)}):"
              f" median {times[len(times) // 2] * 1e3:.2f} ms, mean {sum(times) / len(times) * 1e3:.2f} ms "
              f"(device timestamps, no profiler)")
        return
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
              f"own keys a row {sum(c for _, c, _ in log) / sum(seqs):.0f} on average, "
              f"step {sum(t for _, _, t in log) / len(log) * 1e3:.2f} ms on average (device timestamps)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))


if __name__ == "__main__":
    main()

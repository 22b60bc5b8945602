"""Where a decode step's time goes: host preparation, model forward, sampling.

Runs a dummy model with a shared prefix, lets the batch reach steady decode, then
profiles a few decode steps with torch.profiler: the eager step by default, or with
--graphed the step the engine runs (buffers filled, CUDA graph replayed, sampled).
--variant runs relay's decode attention another way, to compare in the engine what
scripts/device_context_sweep.py times alone: fused (system, then context with the merge
in its epilogue), system-first (system on a high-priority side stream), triton-system
(the Triton system kernel instead of the Gluon one). --brief prints only the step time
and the attention kernels.
Usage:
  python scripts/device_profile.py [--preset llama2-7b] [--prefix 2048] [--batch 256] [--own 64] [--graphed]
                                   [--variant fused|system-first|triton-system] [--brief]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kernels import triton_ops
from models.registry import load_model
from relaycli.compile import prefix_from_ids
from relaycli.config import EngineConfig
from relaycli.engine.engine import Engine, TokenRequest
from relaycli.engine.sequence import SamplingOptions


VARIANTS = {"default": {}, "fused": dict(overlap=False), "system-first": dict(system_side=True),
            "triton-system": dict(sys_config=dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, per_sm=2,
                                                  tma=None, gluon=False))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--relay", type=int, default=1)
    ap.add_argument("--own", type=int, default=64, help="each request's own prompt tokens")
    ap.add_argument("--graphed", action="store_true", help="profile the engine's graphed step instead")
    ap.add_argument("--variant", default="default", choices=list(VARIANTS))
    ap.add_argument("--brief", action="store_true")
    args = ap.parse_args()
    if args.variant != "default":  # the engine's attend looks relay_attention up on the module at each call
        kw = VARIANTS[args.variant]
        triton_ops.relay_attention = lambda *a, **k: triton_ops.relay_attention_with(*a, **k, **kw)
    rng = random.Random(0)
    lm = load_model(f"dummy:{args.preset}", dtype="bfloat16", device="cuda")
    ids = [rng.randrange(lm.config.vocab_size) for _ in range(args.prefix)]
    prefix = prefix_from_ids(lm, ids, "sys")
    reqs = [TokenRequest(i, str(i), ids + [rng.randrange(lm.config.vocab_size) for _ in range(args.own)],
                         SamplingOptions(max_tokens=64, ignore_eos=True), prefix_slot=0) for i in range(args.batch)]
    eng = Engine(lm, [prefix], EngineConfig(max_num_seqs=args.batch, relay=bool(args.relay)))
    for r in reqs:
        eng._admit(r)
    runner = eng.runner
    while eng.scheduler.waiting:
        seqs, is_prefill = eng.scheduler.schedule()
        assert is_prefill
        runner.run(seqs, True)  # appends the first tokens

    def decode_step():
        seqs, is_prefill = eng.scheduler.schedule()
        assert not is_prefill
        t0 = time.perf_counter()
        batch = runner.prepare(seqs, False)
        t1 = time.perf_counter()
        input_ids, positions, meta, last_rows = batch
        hidden = runner.model(input_ids, positions, runner.attention.attend_fn(meta), runner.layer_ops)
        logits = runner.model.compute_logits(hidden[last_rows])
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        for s in seqs:
            s.num_cached_own = s.num_own_tokens
        out = logits.argmax(-1).tolist()
        for s, t in zip(seqs, out):
            s.output_ids.append(t)
        return t1 - t0, t2 - t1, t3 - t2

    def graphed_step():
        seqs, is_prefill = eng.scheduler.schedule()
        assert not is_prefill
        key = runner.graphs.key(seqs)
        t0 = time.perf_counter()
        ids = runner.decode_input_ids(seqs, None)
        runner.graphs._fill(seqs, key[0], key[1], ids)
        t1 = time.perf_counter()
        logits = runner.graphs.run(seqs, key, ids)  # fills again (cheap), then replays
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        for s in seqs:
            s.num_cached_own = s.num_own_tokens
        for s, t in zip(seqs, runner.sampler.sample(logits, [s.sampling for s in seqs],
                                                          [len(s.output_ids) for s in seqs])):
            s.output_ids.append(t)
        return t1 - t0, t2 - t1, t3 - t2

    if args.graphed:
        assert runner.graphs is not None, "CUDA graphs need CUDA and the triton attention impl"
        decode_step = graphed_step  # noqa: F811
        print("graphed: the columns below are fill buffers / fill + replay launch / wait for GPU")
    for _ in range(5):
        decode_step()
    times = [decode_step() for _ in range(10)]
    med = [sorted(x)[len(x) // 2] * 1e3 for x in zip(*times)]
    print(f"median ms: prepare {med[0]:.2f}  forward launch (host) {med[1]:.2f}  wait for GPU {med[2]:.2f}"
          f"  [{args.preset} B={args.batch} own {args.own} {args.variant}]")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            decode_step()
    if args.brief:
        for ev in prof.key_averages():
            total = getattr(ev, "device_time_total", 0.0)
            if total > 0 and any(k in ev.key for k in ("system", "paged", "merge", "relay")):
                print(f"  {ev.key[:32]:32s} {ev.count:4d}x {total / ev.count:8.1f} us")
        return
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()

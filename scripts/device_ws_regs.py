#!/usr/bin/env python
"""Whether the warp-specialised system kernel, capped at fewer registers, lets context
programs run beside it (issue 5's llama3 whole-relay target).

At its default cap (168 a thread, 12 warps) one warp-specialised program claims an SM's
whole register file, so in the overlapped decode step the context kernel's programs wait
for SMs the system kernel has left: the two run one after the other (docs/kernels.md).
Capped lower, the consumers get fewer registers (gluon_system_attention.ws_consumer_regs)
and 2048 - 12 x cap warp-registers an SM stay free for context programs.

For each shape (decode, bf16, 16-token pages, prefix --prefix, 128 own keys a request):
the system kernel alone at each (cap, key tile, stages), with its compiled registers and
spills, then the overlapped relay step (system kernel first on the high-priority side
stream, one program an SM, the context kernel writing a partial, the merge kernel) with
each context tile and register cap, and the step as the engine plans it today. Every
variant is checked against kernels/reference.py. Times: median over CUDA-graph replays,
the L2 emptied clean before each (relaycli/bench/timing.py). Writes TAG.json (ws_regs.json) to $OUT.

Usage: python scripts/device_ws_regs.py [--shapes llama3-8b:256 llama3-8b:64 ...] [--prefix N] [--own N]
           [--sys CAP:BLOCK_N:STAGES ...] [--modes overlap "pdl merge"] [--plan-ctx-only] [--tag T]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

import device_kernels as dk  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.gluon_system_attention import gluon_system_attention_into, ws_consumer_regs  # noqa: E402
from kernels.triton_ops import relay_attention_with  # noqa: E402
from kernels.triton_plan import WS_TILE, num_sms  # noqa: E402
from kernels.triton_system_attention import merge_partials  # noqa: E402

# (cap, BLOCK_N, stages) of the warp-specialised kernel; the twelve-variant sweep of the
# twentieth session's first call found 64-key tiles spill-free down to a cap of 128
SYS_VARIANTS = ((168, 128, 2), (168, 64, 3), (136, 64, 3), (128, 64, 3), (128, 64, 4), (120, 64, 3))
CTX = [None] + [dict(BLOCK_M=16, BLOCK_N=n, num_warps=w, num_stages=2, per_sm=4, heads_fast=True, maxnreg=r)
                for n, w, r in ((32, 2, 128), (32, 1, 128), (64, 4, 96))]
# how the two kernels of the step are launched: side stream, PDL folding in the epilogue,
# PDL writing a partial for the merge kernel
MODES = {"overlap": dict(overlap=True, system_side=True), "pdl fold": dict(pdl=True),
         "pdl merge": dict(pdl=True, pdl_merge=True)}


def splits_for(programs: int, dev) -> int:
    """The most splits (a power of two) that keep the system grid within one program an SM."""
    s = 1
    while programs * s * 2 <= num_sms(dev):
        s *= 2
    return s


def run_shape(name: str, batch: int, prefix: int, own: int, ceil: dict, dev, out: list,
              sys_variants=SYS_VARIANTS, ctx_variants=CTX, modes=MODES) -> None:
    hq, hkv, d = dk.HEADS[name]
    q, kc, vc, pre, meta = dk.build(hq, hkv, d, batch, prefix, own, dev)
    scale = d ** -0.5
    k_sys, v_sys = pre[0]
    rows_idx = meta.prefix_groups[0].query_indices
    want_o = ref.relay_attention(q.float(), kc.float(), vc.float(), meta, [(k_sys.float(), v_sys.float())], scale)
    want_so, _ = ref.system_attention(q.float(), k_sys.float(), v_sys.float(), scale)
    group = hq // hkv
    programs = triton.cdiv(batch * group, WS_TILE["BLOCK_M"]) * hkv
    splits = splits_for(programs, dev)
    sys_bytes = 2 * prefix * hkv * d * 2 + 2 * batch * hq * d * 2
    own_bytes = 2 * batch * own * hkv * d * 2
    flops_sys = 4 * batch * hq * prefix * d
    flops_all = 4 * batch * hq * (prefix + own) * d
    case = f"{name} B={batch} S={prefix}+{own}"

    def floor_us(nbytes, flops):
        return max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e6

    def record(kind, t_us, floor, **extra):
        row = dict(case=case, kind=kind, time_us=t_us, floor_us=floor, pct_floor=100 * floor / t_us, **extra)
        out.append(row)
        print(f"{case:26s} {kind:14s} {t_us:8.1f} us {row['pct_floor']:5.1f}%  "
              + " ".join(f"{k}={v}" for k, v in extra.items()), flush=True)

    def relay_step(**kw):
        fn = lambda: relay_attention_with(q, kc, vc, meta, pre, scale, **kw)  # noqa: E731
        dk.check(f"{case} relay {kw}", fn(), want_o)
        return dk.bench_us(fn)

    record("relay planned", relay_step(), floor_us(sys_bytes + own_bytes, flops_all), config="engine's plan")
    for cap, block_n, stages in sys_variants:
        cfg = dict(WS_TILE, BLOCK_N=block_n, num_stages=stages, ws_regs=cap, gluon=True, tma=True)
        label = dict(cap=cap, consumer_regs=ws_consumer_regs(cap), block_n=block_n, stages=stages)
        try:
            o_p = torch.empty(splits, batch, hq, d, device=dev)
            l_p = torch.empty(splits, batch, hq, device=dev)
            launch = functools.partial(gluon_system_attention_into, q, k_sys, v_sys, scale, o_p, l_p, rows_idx,
                                       splits, 128, block_n, stages, ws=True, ws_regs=cap)
            kernel = launch()
            dk.check(f"{case} system {label}", merge_partials(o_p, l_p, q.dtype)[0], want_so)
            regs = dict(n_regs=getattr(kernel, "n_regs", None), n_spills=getattr(kernel, "n_spills", None),
                        smem=getattr(getattr(kernel, "metadata", None), "shared", None))
            record("system", dk.bench_us(launch), floor_us(sys_bytes, flops_sys), splits=splits, **label, **regs)
            for ctx in ctx_variants:
                for mode, kw in modes.items():
                    t = relay_step(sys_config=cfg, sys_splits=splits, ctx_config=ctx, **kw)
                    record(f"relay {mode}", t, floor_us(sys_bytes + own_bytes, flops_all), splits=splits,
                           **label, ctx=None if ctx is None else
                           f"n{ctx['BLOCK_N']} w{ctx['num_warps']} r{ctx['maxnreg']}")
        except Exception as exc:  # noqa: BLE001 - a cap that does not compile is a result too
            print(f"{case} {label} failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            traceback.print_exc()
            out.append(dict(case=case, kind="failed", error=f"{type(exc).__name__}: {str(exc)[:400]}", **label))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b:256", "llama3-8b:64"])
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--own", type=int, default=128)
    ap.add_argument("--sys", nargs="+", default=None, help="CAP:BLOCK_N:STAGES of the warp-specialised kernel")
    ap.add_argument("--modes", nargs="+", default=None, choices=sorted(MODES))
    ap.add_argument("--plan-ctx-only", action="store_true", help="only the context tile the plan picks")
    ap.add_argument("--tag", default="ws_regs", help="the JSON's name in $OUT")
    args = ap.parse_args()
    sys_variants = [tuple(map(int, v.split(":"))) for v in args.sys] if args.sys else SYS_VARIANTS
    modes = {m: MODES[m] for m in args.modes} if args.modes else MODES
    ctx_variants = [None] if args.plan_ctx_only else CTX
    dev = torch.device("cuda")
    ceil = dk.ceilings(dev)
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} "
          f"TFLOP/s", flush=True)
    rows: list = []
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:  # the JSON is rewritten after every shape, so a cut-off run keeps what it did
        name, batch = shape.split(":")
        run_shape(name, int(batch), args.prefix, args.own, ceil, dev, rows, sys_variants, ctx_variants, modes)
        dk.save_rows(out_dir / f"{args.tag}.json", ceil, rows)
    dk.report_checks()


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Ceilings, correctness and timings of the Triton attention kernels on one CUDA GPU.

Measures in one run: copy bandwidth (read + write bytes) and bf16 matmul rate, then for
llama2-7b heads (Hq=Hkv=32, D=128) and llama3-8b heads (Hq=32, Hkv=8, D=128), batch 64
and 256, prefix 8192 (--prefixes), 128 own keys per request (decode, bf16, the engine's
64-key blocks): (a) the system-attention kernel alone, (b) whole relay attention, (c) the
no-relay paged baseline, (d) per-request cuDNN SDPA on contiguous KV, and (e) the
baseline at batch 64 with 8192 own keys each against copy bandwidth. Every kernel is
first checked against kernels/reference.py in fp32. Every time is taken twice, with the
L2 emptied before each run by reading a large buffer (clean: the % of floor) and by
zeroing one as triton's do_bench does (dirty: the run also writes those lines back;
relaycli/bench/timing.py).
Writes kernels.json and kernels.md to $OUT (else ./out) and prints the table last.
--sweep also times alternative tile configs.

Usage: python scripts/device_kernels.py [--sweep] [--sys-only] [--prefixes 8192 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from relaycli.kernels import planner  # noqa: E402
from relaycli.kernels import reference as ref  # noqa: E402
from relaycli.kernels.system_plan import resolve  # noqa: E402
from relaycli.kernels.tiles import Tile  # noqa: E402
from relaycli.kernels.triton_context_attention import paged_attention  # noqa: E402
from relaycli.kernels.triton_ops import execute, relay_attention  # noqa: E402
from relaycli.kernels.triton_paged_decode import group_prefixes, run_baseline  # noqa: E402
from relaycli.kernels.triton_paged_decode import prefix_paged_attention as baseline  # noqa: E402
from relaycli.kernels.triton_plan import split_plan, system_config  # noqa: E402
from relaycli.kernels.triton_merge import merge_partials  # noqa: E402
from relaycli.kernels.triton_system_attention import system_attention_into  # noqa: E402
from relaycli.bench.kernels import build_step  # noqa: E402
from relaycli.bench.roofline import measure_ceilings  # noqa: E402
from relaycli.bench.timing import cuda_median_us, l2_flusher, replayed  # noqa: E402

HEADS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}
SYS_SWEEP = [Tile(m, n, w, st, per_sm=ps, tma=True, gluon=g, ws=ws)
             for m, n, w, st, ps, g, ws in [
                 (64, 64, 4, 3, 2, False, False), (128, 128, 8, 3, 1, False, False),  # Triton
                 (64, 64, 4, 3, 2, True, False), (64, 64, 4, 2, 3, True, False),  # Gluon (Hopper)
                 (64, 128, 4, 2, 1, True, False), (128, 64, 8, 3, 1, True, False),
                 (128, 64, 4, 3, 1, True, True), (128, 64, 4, 4, 1, True, True),  # warp-specialised
                 (128, 128, 4, 2, 1, True, True)]]
PAGED_SWEEP = [Tile(16, n, w, s, per_sm=4, heads_fast=hf)
               for n, w, s, hf in [(64, 4, 2, False), (64, 4, 2, True), (32, 4, 3, True), (64, 2, 3, True),
                                   (32, 2, 2, True), (128, 4, 1, True), (32, 2, 5, True), (64, 4, 5, True)]] + \
              [Tile(16, n, w, s, per_sm=4, heads_fast=True, bt_ahead=True)
               for n, w, s in [(32, 2, 3), (64, 4, 3), (64, 4, 4)]]
rows: list[dict] = []
checks: list[dict] = []
flusher = functools.cache(l2_flusher)  # one 256 MB buffer per way of emptying the L2, made on first use


def bench_both_us(fn, both: bool = True) -> tuple[float, float | None]:
    """GPU time of fn in microseconds, (L2 emptied clean, dirty): the median over replays of a
    CUDA graph of fn, so Python and launch overhead stay out; eager if capture fails."""
    fn()
    torch.cuda.synchronize()
    try:  # a throwaway capture first: kernels chosen only under capture (TMA) compile here
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fn()
    except Exception:  # noqa: BLE001 - the real capture below reports
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - report, then time eagerly
        print(f"graph capture failed ({type(exc).__name__}: {exc}); timing eagerly", flush=True)
        run = fn
    t = cuda_median_us(run, flusher("clean")), cuda_median_us(run, flusher("dirty")) if both else None
    del graph
    return t


def eager_us(fn) -> float:
    """Eager time including Python and launch overhead (hidden only behind do_bench's L2 flush)."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def build(hq, hkv, d, batch, prefix, own, dev, page=None, dtype=torch.bfloat16):
    """Decode step: q [B, Hq, D], shuffled paged own keys, one prefix shared by every request.
    Fresh random inputs every call (relay bench's builder, with a randomly seeded generator).
    page: keys a cache block (None: the engine's, triton_plan.default_block_size)."""
    gen = torch.Generator(device=dev)
    gen.seed()
    return build_step(hq, hkv, d, batch, prefix, own, dev, dtype, gen, page)


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    ok = bool(torch.isfinite(got).all()) and err < 1e-2
    checks.append(dict(name=name, rel_err=err, ok=ok))
    print(f"check {name}: rel err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)


def add(case, kernel, times, nbytes, flops, ceil, cudnn=None, config=None, eager=None):
    """times, cudnn: bench_both_us's (clean, dirty) pair; the clean time is the row's time."""
    (t_us, t_dirty), cudnn_us = times, cudnn[0] if cudnn else None
    floor = max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e6
    bound = "bytes" if nbytes / ceil["copy_bytes_per_s"] >= flops / ceil["bf16_flops_per_s"] else "flops"
    rows.append(dict(case=case, kernel=kernel, time_us=t_us, time_us_dirty_l2=t_dirty, bytes=nbytes, flops=flops,
                     floor_us=floor, bound=bound, pct_floor=100 * floor / t_us,
                     pct_floor_dirty_l2=100 * floor / t_dirty, vs_cudnn=(cudnn_us / t_us) if cudnn_us else None,
                     config=config, eager_us=eager))
    print(f"{case:28s} {kernel:34s} {t_us:9.1f} us (dirty L2 {t_dirty:7.1f})  floor {floor:7.1f} ({bound})  "
          f"{100 * floor / t_us:5.1f}%", flush=True)


def cudnn_time(q, k_full, v_full, scale):
    """Per-request SDPA through cuDNN on [B, H, S+C, D] KV; GQA through enable_gqa, else expanded."""
    qq = q[:, :, None, :]
    g = q.shape[1] // k_full.shape[1]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            fn = lambda: F.scaled_dot_product_attention(qq, k_full, v_full, scale=scale, enable_gqa=g > 1)  # noqa
            out = fn()
            how = "enable_gqa" if g > 1 else "mha"
        except RuntimeError:
            k_x, v_x = k_full.repeat_interleave(g, 1), v_full.repeat_interleave(g, 1)
            fn = lambda: F.scaled_dot_product_attention(qq, k_x, v_x, scale=scale)  # noqa
            out = fn()
            how = "expanded KV"
        return bench_both_us(fn), eager_us(fn), out[:, :, 0], how


def relay_plans(q, kc, vc, meta, pre) -> dict:
    """The plans relay's step is timed with, built from the planner's: the engine's (the step
    as a CUDA graph's: the fused own-key kernel where it pays), the eager step's (the fused
    epilogue), the overlapped one of a graph without the fused kernel, and that overlap with
    the context kernel first."""
    groups = group_prefixes(meta, pre)
    graphed = dataclasses.replace(meta, graphed=True, _cache={})
    overlap = planner.plan_relay_shape(planner.step_shape(q, kc, graphed, groups), fused_layout=False)
    return {"engine plan": (planner.plan_relay(q, kc, vc, graphed, groups), graphed),
            "fused epilogue": (planner.plan_relay(q, kc, vc, meta, groups), meta),
            "overlap": (overlap, graphed),
            "overlap, context first": (dataclasses.replace(overlap, system_first=False), graphed)}


def baseline_tile(q, kc, vc, meta, pre, scale, tile):
    """The baseline with every launch on this tile (its program order, heads_fast, the tile's)."""
    plan = planner.plan_baseline(q, kc, meta, group_prefixes(meta, pre))
    plan = dataclasses.replace(plan, ctx_tiles=(tile,) * len(plan.ctx_tiles))
    return run_baseline(plan, q, kc, vc, meta, pre, scale)


def relay_case(name, hq, hkv, d, batch, ceil, dev, sweep, S=8192, C=128, sys_only=False):
    q, kc, vc, pre, meta = build(hq, hkv, d, batch, S, C, dev)
    scale = d ** -0.5
    case = f"{name} B={batch} S={S}+{C}"
    k_sys, v_sys = pre[0]
    kv_sys = 2 * S * hkv * d * 2
    kv_own = 2 * batch * C * hkv * d * 2
    qo = 2 * batch * hq * d * 2
    flops_sys, flops_all = 4 * batch * hq * S * d, 4 * batch * hq * (S + C) * d
    want_o = ref.relay_attention(q.float(), kc.float(), vc.float(), meta, [(k_sys.float(), v_sys.float())], scale)
    want_so, want_sl = ref.system_attention(q.float(), k_sys.float(), v_sys.float(), scale)
    rows_idx = meta.prefix_groups[0].query_indices

    merge = planner.merge_tile(batch, hq, d, dev)

    def sys_runner(cfg):
        cfg = cfg or resolve(system_config(batch * hq // hkv, d, q.device, q.element_size(), hkv), False)
        prog = triton.cdiv(batch * hq // hkv, cfg.block_m) * hkv
        splits, _ = split_plan(S, prog, q.device, cfg.block_n, per_sm=cfg.per_sm)
        o_p = torch.empty(splits, batch, hq, d, device=dev)
        l_p = torch.empty(splits, batch, hq, device=dev)
        return (lambda: system_attention_into(q, k_sys, v_sys, scale, o_p, l_p, rows_idx, cfg)), o_p, l_p

    fn, o_p, l_p = sys_runner(None)
    fn()
    so, sl = merge_partials(o_p, l_p, q.dtype, merge)
    check(f"{case} system o", so, want_so)
    check(f"{case} system lse", sl, want_sl)
    plans = relay_plans(q, kc, vc, meta, pre)
    check(f"{case} relay eager", relay_attention(q, kc, vc, meta, pre, scale), want_o)
    for label, (plan, m) in plans.items():
        check(f"{case} relay {label} ({plan.kind})", replayed(lambda: execute(plan, q, kc, vc, m, pre, scale)), want_o)
    tot = kv_sys + kv_own + qo
    if sys_only:
        for cfg in SYS_SWEEP:
            try:
                run_cfg, o_c, l_c = sys_runner(cfg)
                run_cfg()
                check(f"{case} system {cfg}", merge_partials(o_c, l_c, q.dtype, merge)[0], want_so)
                add(case, "(a) system kernel [sweep]", bench_both_us(run_cfg), kv_sys + qo, flops_sys, ceil, None,
                    dataclasses.asdict(cfg))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                print(f"config {cfg} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        for label in ("engine plan", "fused epilogue", "overlap"):
            plan, m = plans[label]
            fn_relay = lambda: execute(plan, q, kc, vc, m, pre, scale)  # noqa: E731
            add(case, f"(b) relay {label}", bench_both_us(fn_relay), tot, flops_all, ceil, None, plan.kind)
        return
    check(f"{case} baseline", baseline(q, kc, vc, meta, pre, scale), want_o)
    k_full = torch.cat([k_sys.transpose(0, 1)[None].expand(batch, -1, -1, -1),
                        ref.gather_context(kc, meta).transpose(1, 2)], 2).contiguous()
    v_full = torch.cat([v_sys.transpose(0, 1)[None].expand(batch, -1, -1, -1),
                        ref.gather_context(vc, meta).transpose(1, 2)], 2).contiguous()
    t_cudnn, e_cudnn, out_cudnn, how = cudnn_time(q, k_full, v_full, scale)
    check(f"{case} cuDNN ({how})", out_cudnn, want_o)
    del k_full, v_full
    torch.cuda.empty_cache()
    add(case, f"(d) cuDNN per-request ({how})", t_cudnn, tot, flops_all, ceil, t_cudnn, eager=e_cudnn)
    add(case, "(a) system kernel", bench_both_us(fn), kv_sys + qo + batch * hq * 4, flops_sys, ceil, None, "default")
    # (b) relay engine plan: what a graphed decode step of the engine runs (the planner picks the
    # fused own-key kernel where it pays); the others are the planner's other kinds for this step
    for label, (plan, m) in plans.items():
        fn_relay = lambda: execute(plan, q, kc, vc, m, pre, scale)  # noqa: E731
        add(case, f"(b) relay {label}", bench_both_us(fn_relay), tot, flops_all, ceil, t_cudnn, plan.kind,
            eager_us(fn_relay))
    fn_base = lambda: baseline(q, kc, vc, meta, pre, scale)  # noqa: E731
    add(case, "(c) baseline paged", bench_both_us(fn_base), tot, flops_all, ceil, t_cudnn, "default", eager_us(fn_base))
    if sweep:
        for cfg in SYS_SWEEP:
            add(case, "(a) system kernel [sweep]", bench_both_us(sys_runner(cfg)[0]), kv_sys + qo, flops_sys, ceil,
                None, dataclasses.asdict(cfg))
        for cfg in PAGED_SWEEP:
            out = torch.empty(1, batch, hq, d, device=dev, dtype=q.dtype)
            t = bench_both_us(lambda: paged_attention(q, kc, vc, meta, scale, out=out, sys_part=(o_p, l_p), tile=cfg))
            add(case, "context+fusion kernel [sweep]", t, kv_own + qo, 4 * batch * hq * C * d, ceil, None,
                dataclasses.asdict(cfg))
            t = bench_both_us(lambda: baseline_tile(q, kc, vc, meta, pre, scale, cfg))
            add(case, "(c) baseline paged [sweep]", t, tot, flops_all, ceil, t_cudnn, dataclasses.asdict(cfg))


def bandwidth_case(name, hq, hkv, d, ceil, dev, sweep, batch=64, own=8192):
    q, kc, vc, _, meta = build(hq, hkv, d, batch, 0, own, dev)
    scale = d ** -0.5
    case = f"{name} B={batch} own={own}"
    want = ref.context_attention(q.float(), kc.float(), vc.float(), meta, scale)[0]
    check(f"{case} baseline", baseline(q, kc, vc, meta, [], scale), want)
    nbytes = 2 * batch * own * hkv * d * 2 + 2 * batch * hq * d * 2
    flops = 4 * batch * hq * own * d
    fn_base = lambda: baseline(q, kc, vc, meta, [], scale)  # noqa: E731
    add(case, "(e) baseline paged", bench_both_us(fn_base), nbytes, flops, ceil, None, "default", eager_us(fn_base))
    for cfg in PAGED_SWEEP if sweep else []:
        add(case, "(e) baseline paged [sweep]", bench_both_us(lambda: baseline_tile(q, kc, vc, meta, [], scale, cfg)),
            nbytes, flops, ceil, None, dataclasses.asdict(cfg))


def table(ceil, info) -> str:
    lines = [f"Device: {info['device']} ({info['sms']} SMs), torch {info['torch']}, triton {info['triton']}; "
             f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
             f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s (8192^3, random).", "",
             "Time: CUDA-graph replay, median of CUDA events, the L2 emptied before each run by reading",
             "256 MB (clean); dirty: emptied by zeroing 256 MB as triton's do_bench does, so the run also",
             "writes those lines back. Eager: the same call from Python, launch overhead included.", "",
             "| case | kernel | time (us) | dirty L2 (us) | eager (us) | floor (us) | bound | % of floor "
             "| % dirty | vs cuDNN |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        if "[sweep]" in r["kernel"]:
            continue
        vs = f"{r['vs_cudnn']:.1f}x" if r["vs_cudnn"] else ""
        eager = f"{r['eager_us']:.1f}" if r["eager_us"] else ""
        lines.append(f"| {r['case']} | {r['kernel']} | {r['time_us']:.1f} | {r['time_us_dirty_l2']:.1f} | {eager} | "
                     f"{r['floor_us']:.1f} | {r['bound']} | {r['pct_floor']:.0f}% | {r['pct_floor_dirty_l2']:.0f}% "
                     f"| {vs} |")
    bad = [c["name"] for c in checks if not c["ok"]]
    lines += ["", f"Correctness: {len(checks) - len(bad)}/{len(checks)} checks within 1e-2 relative error"
              + (f"; FAILED: {', '.join(bad)}" if bad else ".")]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--sys-only", action="store_true", help="only system-kernel configs and relay totals")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[8192], help="shared prefix lengths")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT") or "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(dev)
    info = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                triton=triton.__version__)
    c = measure_ceilings(dev, torch.bfloat16)  # best of 5: a 1 GiB bf16 copy, an 8192^3 bf16 matmul
    ceil = dict(copy_bytes_per_s=c.bandwidth, bf16_flops_per_s=c.matmul_rate)
    print(f"ceilings: {ceil}", flush=True)
    errors = []
    for name, (hq, hkv, d) in HEADS.items():
        for prefix in args.prefixes:
            for batch in (64, 256):
                try:
                    relay_case(name, hq, hkv, d, batch, ceil, dev, args.sweep, S=prefix, sys_only=args.sys_only)
                except Exception:  # keep the other cases' numbers
                    errors.append(traceback.format_exc())
                    print(errors[-1], flush=True)
                torch.cuda.empty_cache()
        try:
            if not args.sys_only:
                bandwidth_case(name, hq, hkv, d, ceil, dev, args.sweep)
        except Exception:
            errors.append(traceback.format_exc())
            print(errors[-1], flush=True)
        torch.cuda.empty_cache()
    md = table(ceil, info)
    (out_dir / "kernels.json").write_text(json.dumps(dict(info=info, ceilings=ceil, rows=rows, checks=checks,
                                                          errors=errors), indent=1, default=str))
    (out_dir / "kernels.md").write_text(md + "\n")
    sweeps = [r for r in rows if "[sweep]" in r["kernel"]]
    for r in sweeps:
        print(f"sweep {r['case']:26s} {r['kernel']:32s} {r['time_us']:8.1f} us {r['pct_floor']:5.1f}% {r['config']}",
              flush=True)
    print(md)


if __name__ == "__main__":
    main()

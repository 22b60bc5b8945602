#!/usr/bin/env python
"""The own keys inside the warp-specialised system program (kernels/gluon_fused_relay.py)
against the older plan (issue 5's llama3 whole-relay target).

Per shape (decode, bf16, prefix --prefix, --own own keys a request): the plan of the
engine before the twenty-third session (fused=False) on 16-key pages and on 64-key pages
(the fused kernel reads one 64-key block a chunk), the engine's plan now (graphed, 64-key
pages: the fused kernel where triton_plan.fused_decode_plan says it pays), the
warp-specialised system kernel alone, and the fused step (fused kernel + merge) for each
variant of its knobs (--variants; CTX_MODE 2 leaves the own keys out, to time the prefix
part alone), with the compiled registers and spills. Every variant is checked
against kernels/reference.py, and the fused step also at ragged own lengths and odd
batches. Times: median over CUDA-graph replays, the L2 emptied clean before each. Writes
TAG.json to $OUT.

Usage: python scripts/device_fused_relay.py [--shapes llama3-8b:256 llama3-8b:64] [--prefix N] [--own N]
           [--variants BN:STAGES:CTX_TILES:MODE:SYS_REGS:CTX_REGS[:Q_SMEM] ...] [--smoke] [--no-checks] [--tag T]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

import device_kernels as dk  # noqa: E402
from device_ws_regs import splits_for  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.gluon_fused_relay import fused_relay_decode, fused_relay_partials  # noqa: E402
from kernels.gluon_system_attention import gluon_system_attention_into  # noqa: E402
from kernels.triton_ops import relay_attention_with  # noqa: E402
from kernels.triton_plan import WS_TILE, fused_tile  # noqa: E402
from kernels.triton_system_attention import merge_partials  # noqa: E402
from relaycli.bench.timing import replayed  # noqa: E402


# BLOCK_N:STAGES:CTX_TILES:CTX_MODE:SYS_REGS:CTX_REGS[:Q_SMEM] (kernels/gluon_fused_relay.py's
# knobs; Q_SMEM defaults to 0). The merge is launched as fused_relay_decode's default has it (a
# programmatic dependent since the twenty-sixth session; --merge-probe times it both ways).
VARIANTS = ["64:3:4:0:176:136", "64:3:4:2:176:136", "64:4:4:0:176:136", "64:3:6:0:176:136", "64:3:4:0:184:120"]


def parse(variant: str) -> dict:
    fields = list(map(int, variant.split(":")))
    assert len(fields) in (6, 7), f"variant {variant!r}: 6 or 7 fields"
    bn, stages, ctx_tiles, mode, sys_regs, ctx_regs = fields[:6]
    return dict(block_n=bn, stages=stages, ctx_tiles=ctx_tiles, ctx_mode=mode, sys_regs=sys_regs,
                ctx_regs=ctx_regs, q_smem=bool(fields[6]) if len(fields) == 7 else False)


def fused_fn(q, kc, vc, meta, pre, scale, splits, variant: str = VARIANTS[0]):
    k_sys, v_sys = pre[0]
    return functools.partial(fused_relay_decode, q, k_sys, v_sys, kc, vc, meta.block_tables, meta.context_lens,
                             scale, splits, **parse(variant))


def checks_only(name: str, dev, prefix: int, variants) -> None:
    """Ragged own lengths (1 .. 300, a block's edge included) and batches that end inside a tile."""
    hq, hkv, d = dk.HEADS[name]
    rng = random.Random()
    for batch in (256, 37, 5):
        lens = [rng.choice([1, 63, 64, 65, 128, rng.randint(1, 300)]) for _ in range(batch)]
        gen = torch.Generator(device=dev)
        gen.seed()
        q, kc, vc, pre, meta = dk.build_step(hq, hkv, d, batch, prefix, 0, dev, torch.bfloat16, gen, 64, lens)
        k_sys, v_sys = pre[0]
        want = ref.relay_attention(q.float(), kc.float(), vc.float(), meta, [(k_sys.float(), v_sys.float())],
                                   d ** -0.5)
        programs = triton.cdiv(batch * (hq // hkv), 128) * hkv
        for variant in variants:
            if parse(variant)["ctx_mode"] == 2:
                continue
            for splits in sorted({1, splits_for(programs, dev)}):
                got, _ = fused_fn(q, kc, vc, meta, pre, d ** -0.5, splits, variant)()
                dk.check(f"{name} fused {variant} ragged B={batch} splits={splits}", got, want)


def step_floor_us(name: str, batch: int, prefix: int, own: int, ceil: dict) -> float:
    """The decode step's floor: the prefix, own K/V and q read once, or its matrix work."""
    hq, hkv, d = dk.HEADS[name]
    byts = 2 * prefix * hkv * d * 2 + 2 * batch * hq * d * 2 + 2 * batch * own * hkv * d * 2
    flops = 4 * batch * hq * (prefix + own) * d
    return max(byts / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"]) * 1e6


def recorder(case: str, floor: float, out: list):
    """record(kind, time_us, **extra): a row against floor, appended to out and printed."""
    def record(kind, t_us, **extra):
        row = dict(case=case, kind=kind, time_us=t_us, floor_us=floor, pct_floor=100 * floor / t_us, **extra)
        out.append(row)
        print(f"{case:26s} {kind:26s} {t_us:8.1f} us {row['pct_floor']:5.1f}%  "
              + " ".join(f"{k}={v}" for k, v in extra.items()), flush=True)
    return record


def run_shape(name: str, batch: int, prefix: int, own: int, ceil: dict, dev, out: list, variants) -> None:
    hq, hkv, d = dk.HEADS[name]
    scale = d ** -0.5
    case = f"{name} B={batch} S={prefix}+{own}"
    group = hq // hkv
    record = recorder(case, step_floor_us(name, batch, prefix, own, ceil), out)

    for page in (16, 64):
        q, kc, vc, pre, meta = dk.build(hq, hkv, d, batch, prefix, own, dev, page=page)
        k_sys, v_sys = pre[0]
        want = ref.relay_attention(q.float(), kc.float(), vc.float(), meta, [(k_sys.float(), v_sys.float())], scale)
        plan = lambda: relay_attention_with(q, kc, vc, meta, pre, scale, fused=False)  # noqa: E731
        dk.check(f"{case} plan page {page}", plan(), want)
        record(f"plan, page {page}", dk.bench_us(plan))
    engine = lambda: relay_attention_with(q, kc, vc, meta, pre, scale)  # noqa: E731
    dk.check(f"{case} engine plan (graphed)", replayed(engine), want)
    record("engine plan, page 64", dk.bench_us(engine))
    programs = triton.cdiv(batch * group, WS_TILE["BLOCK_M"]) * hkv
    splits = splits_for(programs, dev)
    o_p = torch.empty(splits, batch, hq, d, device=dev)
    l_p = torch.empty(splits, batch, hq, device=dev)
    system = functools.partial(gluon_system_attention_into, q, k_sys, v_sys, scale, o_p, l_p, None, splits, 128, 128,
                               2, ws=True)
    system()
    record("system alone (ws)", dk.bench_us(system), splits=splits)
    # the merge kernel alone on the fused step's partials (its share of the step), by how many
    # partials it loads at once (None: triton_plan.merge_unroll's choice)
    parts_o = torch.randn(splits + 1, batch, hq, d, device=dev)
    parts_l = torch.randn(splits + 1, batch, hq, device=dev)
    for unroll in (None, 1, 2, 4, splits + 1):
        record("merge alone", dk.bench_us(lambda: merge_partials(parts_o, parts_l, q.dtype, with_lse=False,
                                                                 unroll=unroll)), splits=splits + 1, unroll=unroll)
    tile = fused_tile(batch, hq, hkv)  # the engine's tile, with every partial in flight at once in the merge
    fn = functools.partial(fused_relay_decode, q, k_sys, v_sys, kc, vc, meta.block_tables, meta.context_lens, scale,
                           splits, merge_unroll=splits + 1, **tile)
    dk.check(f"{case} fused engine tile, merge unroll {splits + 1}", fn()[0], want)
    record("fused + merge unroll all", dk.bench_us(fn), splits=splits, tile=str(tile))
    for variant in variants:
        for s in (splits,):  # half as many splits was slower in every step measured (twenty-second session)
            try:
                fn = fused_fn(q, kc, vc, meta, pre, scale, s, variant)
                got, kernel = fn()
                if parse(variant)["ctx_mode"] != 2:  # mode 2 leaves the own keys out: timing only
                    dk.check(f"{case} fused {variant} splits={s}", got, want)
                record("fused + merge", dk.bench_us(fn), splits=s, variant=variant,
                       n_regs=getattr(kernel, "n_regs", None), n_spills=getattr(kernel, "n_spills", None),
                       smem=getattr(getattr(kernel, "metadata", None), "shared", None))
            except Exception as exc:  # noqa: BLE001 - a variant that fails is a result too
                traceback.print_exc()
                out.append(dict(case=case, kind="failed", variant=variant, splits=s,
                                error=f"{type(exc).__name__}: {str(exc)[:400]}"))


def merge_probe(name: str, batch: int, prefix: int, own: int, ceil: dict, dev, out: list,
                pdl_only: bool = False) -> None:
    """Where the merge's share of the step goes: the engine tile's fused kernel alone, with a
    one-element fill after it (a second launch that does no work), and with the merge at
    each (heads a program, warps, partials in flight), in the step and alone; every merge's
    bits against the default's; the step with the merge a programmatic dependent (pdl_only:
    these rows alone)."""
    hq, hkv, d = dk.HEADS[name]
    scale = d ** -0.5
    case = f"{name} B={batch} S={prefix}+{own}"
    record = recorder(case, step_floor_us(name, batch, prefix, own, ceil), out)
    q, kc, vc, pre, meta = dk.build(hq, hkv, d, batch, prefix, own, dev, page=64)
    k_sys, v_sys = pre[0]
    want = ref.relay_attention(q.float(), kc.float(), vc.float(), meta, [(k_sys.float(), v_sys.float())], scale)
    splits = splits_for(triton.cdiv(batch * (hq // hkv), WS_TILE["BLOCK_M"]) * hkv, dev)
    tile = fused_tile(batch, hq, hkv)
    parts = functools.partial(fused_relay_partials, q, k_sys, v_sys, kc, vc, meta.block_tables, meta.context_lens,
                              scale, splits, **tile)
    one = torch.zeros(1, device=dev)

    record("partials alone", dk.bench_us(parts), splits=splits)
    record("partials + empty launch", dk.bench_us(lambda: (parts(), one.zero_())), splits=splits)
    o_p, l_p, _ = parts()
    base = merge_partials(o_p, l_p, q.dtype, with_lse=False)[0]
    dk.check(f"{case} merge probe default", base, want)
    # the merge as a programmatic dependent that the fused kernel never triggers: placed as the
    # fused kernel's last programs leave, not after the kernel boundary (the twenty-fourth
    # session's early trigger let its programs take slots first, and was slower)
    pdl_step = functools.partial(fused_relay_decode, q, k_sys, v_sys, kc, vc, meta.block_tables, meta.context_lens,
                                 scale, splits, pdl_merge=True, **tile)
    dk.check_bits(f"{case} pdl merge against the default merge", replayed(lambda: pdl_step()[0]), base)
    record("step, merge", dk.bench_us(lambda: merge_partials(*parts()[:2], q.dtype, with_lse=False)[0]), pdl=False)
    record("step, pdl merge", dk.bench_us(pdl_step), pdl=True)
    if pdl_only:
        return
    for block_h in (None, 16, 8, 4, 2):  # None: triton_plan.merge_block_h's choice
        for warps in (4, 2):
            for unroll in (None, splits + 1):
                kw = dict(unroll=unroll, block_h=block_h, num_warps=warps)
                # the same fold order: any difference is a bug
                dk.check_bits(f"{case} merge {kw} against the default merge",
                              merge_partials(o_p, l_p, q.dtype, with_lse=False, **kw)[0], base)
                step = lambda: merge_partials(*parts()[:2], q.dtype, with_lse=False, **kw)  # noqa: E731
                record("step, merge", dk.bench_us(step), **kw)
                record("merge alone", dk.bench_us(lambda: merge_partials(o_p, l_p, q.dtype, with_lse=False, **kw)),
                       **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b:256", "llama3-8b:64"])
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--own", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=VARIANTS,
                    help="BLOCK_N:STAGES:CTX_TILES:CTX_MODE:SYS_REGS:CTX_REGS[:Q_SMEM]")
    ap.add_argument("--no-checks", action="store_true", help="skip the ragged-length checks")
    ap.add_argument("--tag", default="fused_relay")
    ap.add_argument("--smoke", action="store_true", help="one small fused step against the reference, then exit")
    ap.add_argument("--merge-probe", action="store_true", help="the merge's share of the step, by merge config")
    ap.add_argument("--pdl-only", action="store_true", help="with --merge-probe: the PDL merge rows alone")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.smoke:  # run under a timeout first: a kernel whose barriers deadlock hangs the GPU
        hq, hkv, d = dk.HEADS["llama3-8b"]
        gen = torch.Generator(device=dev)
        gen.seed()
        q, kc, vc, pre, meta = dk.build_step(hq, hkv, d, 40, 512, 0, dev, torch.bfloat16, gen, 64, [100] * 40)
        want = ref.relay_attention(q.float(), kc.float(), vc.float(), meta, [(pre[0][0].float(), pre[0][1].float())], d ** -0.5)
        for splits in (1, 2):
            got, kernel = fused_fn(q, kc, vc, meta, pre, d ** -0.5, splits, args.variants[0])()
            torch.cuda.synchronize()
            print("smoke regs", getattr(kernel, "n_regs", None), "spills", getattr(kernel, "n_spills", None))
            dk.check(f"smoke splits={splits}", got, want)
        return
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_checks:
        for name in sorted({s.split(":")[0] for s in args.shapes}):
            try:
                checks_only(name, dev, 2048, args.variants)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    ceil = dk.ceilings(dev)
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} "
          f"TFLOP/s", flush=True)
    rows: list = []
    if args.merge_probe:
        for shape in args.shapes:
            name, batch = shape.split(":")
            merge_probe(name, int(batch), args.prefix, args.own, ceil, dev, rows, args.pdl_only)
            dk.save_rows(out_dir / f"{args.tag}.json", ceil, rows)
        dk.report_checks()
        return
    for shape in args.shapes:
        name, batch = shape.split(":")
        run_shape(name, int(batch), args.prefix, args.own, ceil, dev, rows, args.variants)
        dk.save_rows(out_dir / f"{args.tag}.json", ceil, rows)
    dk.report_checks()


if __name__ == "__main__":
    main()

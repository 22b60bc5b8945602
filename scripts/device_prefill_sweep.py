"""Prefill attention at engine shapes: relay's system kernel against the --no-relay paged kernel.

A prefill round of `relay bench e2e` packs about 8,192 new tokens (32 requests x 256)
against one long shared prefix. Both paths do the same flops over the prefix, so a
slower relay prefill means a worse tile for that work. This times the system kernel's
tile configs (with and without TMA), the causal own-token step, the whole relay prefill
attention and the baseline, prints TFLOP/s against the matmul rate, and checks every
result against kernels/reference.py on a slice of rows.
Usage: python scripts/device_prefill_sweep.py [--prefix 8192] [--seqs 32] [--own 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from device_kernels import HEADS, bench_us  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.metadata import AttentionMetadata, PrefixGroup  # noqa: E402
from kernels.triton_ops import prefix_paged_attention, relay_attention  # noqa: E402
from kernels.triton_context_attention import context_attention  # noqa: E402
from kernels.triton_plan import system_config  # noqa: E402
from kernels.triton_system_attention import system_attention_into  # noqa: E402
from relaycli.bench.roofline import measure_ceilings  # noqa: E402

SYS_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, tma=t)
               for m, n, w, s, t in [(64, 64, 4, 3, False), (64, 64, 4, 3, True), (128, 64, 8, 3, False),
                                     (128, 64, 8, 3, True), (128, 128, 8, 2, True), (128, 64, 4, 3, True),
                                     (128, 128, 8, 3, True), (64, 128, 4, 3, True)]]


def prefill_step(hq, hkv, d, num_seqs, own, system, dev, gen, page=16):
    """Every sequence prefills `own` tokens after the shared prefix; shuffled block tables."""
    per_seq = -(-own // page)
    tables = torch.randperm(num_seqs * per_seq, generator=gen, device=dev).view(num_seqs, per_seq).to(torch.int32)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.bfloat16)  # noqa: E731
    kc, vc = rnd(num_seqs * per_seq, page, hkv, d), rnd(num_seqs * per_seq, page, hkv, d)
    n = num_seqs * own
    q = rnd(n, hq, d)
    pos = torch.arange(own, device=dev)
    slots = (tables[:, pos // page].to(torch.int64) * page + pos % page).reshape(-1)
    pre = [(rnd(system, hkv, d), rnd(system, hkv, d))]
    groups = [PrefixGroup(0, system, torch.arange(num_seqs, device=dev), torch.arange(n, device=dev))]
    meta = AttentionMetadata(False, torch.arange(0, n + 1, own, device=dev, dtype=torch.int32), own,
                             torch.full((num_seqs,), own, device=dev, dtype=torch.int32), own, tables, slots, page,
                             groups)
    return q, kc, vc, pre, meta


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--own", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="only the default system config, relay and the baseline")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev, torch.bfloat16)
    rate = ceil.matmul_rate
    out_dir = Path(os.environ.get("OUT") or "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=dev)
    gen.seed()
    rows = []
    for name, (hq, hkv, d) in HEADS.items():
        q, kc, vc, pre, meta = prefill_step(hq, hkv, d, args.seqs, args.own, args.prefix, dev, gen)
        n = q.shape[0]
        scale = d ** -0.5
        sys_flops = 4 * n * hq * args.prefix * d
        ctx_flops = 4 * n * hq * (args.own + 1) / 2 * d
        check = slice(0, 512)  # the reference on every row would need the [N, S] scores of every head
        k_s, v_s = pre[0]
        want_o, _ = ref.system_attention(q[check].float(), k_s.float(), v_s.float(), scale)

        def report(what, t_us, flops, err, cfg=None):
            tf = flops / (t_us * 1e-6) / 1e12
            row = dict(case=name, what=what, time_us=t_us, tflops=tf, pct_matmul=100 * tf * 1e12 / rate,
                       rel_err=err, config=cfg)
            rows.append(row)
            print(f"{name:10s} {what:26s} {t_us:9.1f} us {tf:6.1f} TFLOP/s {row['pct_matmul']:5.1f}% "
                  f"err {err:.1e} {cfg or ''}", flush=True)

        default = system_config(n * hq // hkv, d, dev, 2, hkv)
        for cfg in [None] + ([] if args.quick else SYS_CONFIGS):
            c = dict(cfg or default)
            c.pop("per_sm", None)
            if c.get("tma") is None:
                c["tma"] = False  # decode-sized configs use TMA only under graph capture
            o = torch.empty(1, n, hq, d, device=dev, dtype=torch.bfloat16)
            lse = torch.empty(1, n, hq, device=dev, dtype=torch.float32)
            fn = lambda: system_attention_into(q, k_s, v_s, scale, o, lse, None, 1, c)  # noqa: E731
            try:
                t = bench_us(fn)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported and skipped
                print(f"{name} system {c}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            report("system" + (" (default)" if cfg is None else ""), t, sys_flops, rel_err(o[0, check], want_o), c)
        o_ctx = None

        def ctx():
            nonlocal o_ctx
            o_ctx = context_attention(q, kc, vc, meta, scale)[0]
        t = bench_us(ctx)
        want_c, _ = ref.context_attention(q.float(), kc.float(), vc.float(), meta, scale)
        report("context (causal own)", t, ctx_flops, rel_err(o_ctx[check], want_c[check]))
        want_full = ref.relay_attention(q[check].float(), kc.float(), vc.float(), sliced(meta, check, args.own),
                                        [(k_s.float(), v_s.float())], scale)
        out = {}
        t = bench_us(lambda: out.__setitem__("r", relay_attention(q, kc, vc, meta, pre, scale)))
        report("whole relay (eager path)", t, sys_flops + ctx_flops, rel_err(out["r"][check], want_full))
        t = bench_us(lambda: out.__setitem__("b", prefix_paged_attention(q, kc, vc, meta, pre, scale)))
        report("no-relay paged", t, sys_flops + ctx_flops, rel_err(out["b"][check], want_full))
    (out_dir / "prefill_sweep.json").write_text(json.dumps(dict(ceilings=dict(copy_bytes_per_s=ceil.bandwidth, matmul_flops_per_s=rate), rows=rows), indent=1))


def sliced(meta: AttentionMetadata, rows: slice, own: int) -> AttentionMetadata:
    """The metadata of the first sequences only (rows must end on a sequence boundary)."""
    b = (rows.stop - rows.start) // own
    assert rows.start == 0 and b * own == rows.stop
    dev = meta.cu_seqlens_q.device
    g = meta.prefix_groups[0]
    return AttentionMetadata(False, meta.cu_seqlens_q[:b + 1], own, meta.context_lens[:b], own,
                             meta.block_tables[:b], meta.slot_mapping[:rows.stop], meta.block_size,
                             [PrefixGroup(0, g.num_prefix_tokens, torch.arange(b, device=dev),
                                          torch.arange(rows.stop, device=dev))])


if __name__ == "__main__":
    main()

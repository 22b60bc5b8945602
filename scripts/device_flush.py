"""Probe: what the way the L2 is emptied before each timed run adds to a kernel's time.

triton's do_bench zeroes a 256 MB buffer before every run, which leaves the whole L2
dirty; the timed kernel then pays for writing those lines back (relaycli/bench/timing.py).
This times the issue-5 decode attention shapes (llama2-7b and llama3-8b heads, batch 64
and 256, prefix 8,192 + 128 own keys, bf16, graph-replayed) and plain reads of the same
byte counts with the L2 emptied five ways:
  dirty        zero a 256 MB buffer (what do_bench does), timed by relay's timer
  do_bench     triton.testing.do_bench itself (checks that the timer above agrees)
  clean        read a 256 MB buffer (the lines left are clean)
  dirty+clean  zero, then read: the write-back happens in the flush, not in the run
  none         nothing emptied (the run's inputs may sit in the L2)
Every kernel is checked against kernels/reference.py first (fresh random inputs).

    python scripts/device_flush.py --out $OUT/flush.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.triton_ops import relay_attention_with  # noqa: E402
from kernels.triton_paged_decode import prefix_paged_attention as baseline  # noqa: E402
from kernels.triton_plan import split_plan, system_config  # noqa: E402
from kernels.triton_system_attention import system_attention_into  # noqa: E402
from relaycli.bench.kernels import build_step  # noqa: E402
from relaycli.bench.roofline import measure_ceilings  # noqa: E402
from relaycli.bench.timing import cuda_median_us, l2_flusher  # noqa: E402

HEADS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}
MODES = ("dirty", "do_bench", "clean", "dirty+clean", "none")


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):  # variants chosen under capture compile here
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def times(graph, flushers) -> dict:
    out = {}
    for mode in MODES:
        if mode == "do_bench":
            out[mode] = do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
        else:
            out[mode] = cuda_median_us(graph.replay, flushers[mode])
    return out


def check(name, got, want, tol=2e-2):
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < tol, f"{name}: relative error {err:.2e}"
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev, torch.bfloat16)
    dirty, clean = l2_flusher("dirty"), l2_flusher("clean")

    def dirty_then_clean():
        dirty()
        clean()

    flushers = {"dirty": dirty, "clean": clean, "dirty+clean": dirty_then_clean, "none": lambda: None}
    props = torch.cuda.get_device_properties(dev)
    result = {"device": props.name, "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__,
              "triton": triton.__version__, "copy_bytes_per_s": ceil.bandwidth, "matmul_flops_per_s": ceil.matmul_rate,
              "rows": []}
    lines = [f"{props.name}: copy {ceil.bandwidth / 1e12:.2f} TB/s, matmul {ceil.matmul_rate / 1e12:.0f} TFLOP/s, "
             f"L2 {result['l2_bytes']}", "case | kernel | floor us | " + " | ".join(MODES) + " | % floor dirty / clean"]

    def add(case, kernel, graph, nbytes, flops):
        t = times(graph, flushers)
        floor = max(nbytes / ceil.bandwidth, flops / ceil.matmul_rate) * 1e6
        result["rows"].append(dict(case=case, kernel=kernel, floor_us=floor, bytes=nbytes, flops=flops, times_us=t))
        lines.append(f"{case} | {kernel} | {floor:.1f} | " + " | ".join(f"{t[m]:.1f}" for m in MODES)
                     + f" | {100 * floor / t['dirty']:.0f}% / {100 * floor / t['clean']:.0f}%")
        print(lines[-1], flush=True)

    for nbytes in (33_554_432, 134_217_728, 536_870_912):  # plain reads of the cases' byte counts
        x = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
        add(f"read {nbytes / 1e6:.0f} MB", "torch sum", graphed(lambda x=x: x.sum(dtype=torch.float32)), nbytes, 0)
        del x
    for name, (hq, hkv, d) in HEADS.items():
        for batch in (64, 256):
            S, C = 8192, 128
            gen = torch.Generator(device=dev)
            gen.seed()
            q, kc, vc, pre, meta = build_step(hq, hkv, d, batch, S, C, dev, torch.bfloat16, gen)
            scale = d ** -0.5
            case = f"{name} B={batch} S={S}+{C}"
            k_sys, v_sys = pre[0]
            kv_sys, kv_own, qo = 2 * S * hkv * d * 2, 2 * batch * C * hkv * d * 2, 2 * batch * hq * d * 2
            flops_sys, flops_all = 4 * batch * hq * S * d, 4 * batch * hq * (S + C) * d
            want = ref.relay_attention(q.float(), kc.float(), vc.float(), meta, [(k_sys.float(), v_sys.float())],
                                       scale)
            cfg = system_config(batch * hq // hkv, d, q.device, q.element_size(), hkv)
            prog = triton.cdiv(batch * hq // hkv, cfg["BLOCK_M"]) * hkv
            splits, _ = split_plan(S, prog, q.device, cfg["BLOCK_N"], per_sm=cfg.get("per_sm", 1))
            o_p = torch.empty(splits, batch, hq, d, device=dev)
            l_p = torch.empty(splits, batch, hq, device=dev)
            rows_idx = meta.prefix_groups[0].query_indices
            fns = {
                "system kernel": (lambda: system_attention_into(q, k_sys, v_sys, scale, o_p, l_p, rows_idx, splits,
                                                                cfg), kv_sys + qo, flops_sys),
                "relay fused": (lambda: relay_attention_with(q, kc, vc, meta, pre, scale, overlap=False),
                                kv_sys + kv_own + qo, flops_all),
                "relay overlap": (lambda: relay_attention_with(q, kc, vc, meta, pre, scale, overlap=True),
                                  kv_sys + kv_own + qo, flops_all),
                "baseline paged": (lambda: baseline(q, kc, vc, meta, pre, scale), kv_sys + kv_own + qo, flops_all),
            }
            for label in ("relay fused", "relay overlap", "baseline paged"):
                check(f"{case} {label}", fns[label][0](), want)
            for label, (fn, nbytes, flops) in fns.items():
                add(case, label, graphed(fn), nbytes, flops)
            del q, kc, vc, pre, meta, want, o_p, l_p
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

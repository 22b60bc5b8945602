"""Probe: decode-sized weight products in Triton, with and without programmatic dependent launch.

A llama3-8b decode step at small batch is bound by the weights' bytes, yet cuBLAS reaches
only 42-82% of copy bandwidth on its projections (docs/benchmarks.md): each product pays
a ramp-up and a tail. This script times a chain shaped like the dense part of a layer
(add+norm, qkv, o_proj, add+norm, gate_up, silu*mul, down) over several layers with
distinct weights, inside one CUDA graph, three ways:
  cublas   torch's F.linear between Triton norm / silu kernels, all launched normally;
  triton   a swap-AB Triton product (weight rows on the MMA's M side, the batch on N);
  pdl      the same kernels launched with programmatic dependent launch: each kernel
           lets its successor start early (gdc_launch_dependents); the product prefetches
           its weight slab to L2 before griddepcontrol.wait, the only step that waits for
           the previous kernel's output.
Every product is checked against F.linear first.

    python scripts/device_decode_gemm.py --out $OUT/decode_gemm.log
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _prefetch_rows(row_ptrs, nbytes):
    """One bulk L2 prefetch per weight row (sm_90): the copy engine fetches while we wait."""
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                     [row_ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, prefetch_bytes,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K]^T; one program a BLOCK_N slab of weight rows and BLOCK_M batch rows."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    if PREFETCH:  # weights are constants: fetch the first columns while the previous kernel finishes
        _prefetch_rows(w_rows, offs_n * 0 + prefetch_bytes)
    if PDL:  # everything below reads what the previous kernel wrote, or writes what it may read
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    mmask = offs_m < M
    for k in range(0, K, BLOCK_K):
        w = tl.load(w_rows[:, None] + (k + offs_k)[None, :])
        x = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k + offs_k)[:, None], mask=mmask[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    if PDL:  # the next kernel may start its own prologue during this store
        gdc_launch_dependents()
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[None, :])


@triton.jit
def _add_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """r += x (residual, in place); y = rmsnorm(r) * w. One program a row."""
    row = tl.program_id(0)
    if PDL:  # wait first: launching dependents before would let every later kernel launch at once
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    m = offs < N
    r = tl.load(r_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32) + \
        tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(r_ptr + row * N + offs, r.to(r_ptr.dtype.element_ty), mask=m)
    inv = tl.rsqrt(tl.sum(r * r, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, (r * inv * w).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul_kernel(g_ptr, y_ptr, N, stride_g, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if PDL:  # wait first: launching dependents before would let every later kernel launch at once
        gdc_wait()
        gdc_launch_dependents()
    m = col < N
    g = tl.load(g_ptr + row * stride_g + col, mask=m, other=0.0).to(tl.float32)
    u = tl.load(g_ptr + row * stride_g + N + col, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + col, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=m)


def linear(x, w, y, cfg, pdl, prefetch_bytes=0):
    """x [M, K] (unit last stride), w [N, K] contiguous, y [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.is_contiguous() and x.stride(1) == 1 and y.stride(1) == 1
    assert n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0
    _linear_kernel[(n // cfg["BLOCK_N"], triton.cdiv(m, cfg["BLOCK_M"]))](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), min(prefetch_bytes, k * w.element_size()),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PDL=pdl,
        PREFETCH=pdl and prefetch_bytes > 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        launch_pdl=pdl)


def add_norm(x, r, w, y, pdl):
    _add_norm_kernel[(x.shape[0],)](x, r, w, y, x.shape[1], 1e-5, BLOCK=triton.next_power_of_2(x.shape[1]),
                                     PDL=pdl, num_warps=8, launch_pdl=pdl)


def silu_mul(g, y, pdl):
    n = y.shape[1]
    _silu_mul_kernel[(g.shape[0], triton.cdiv(n, 2048))](g, y, n, g.stride(0), BLOCK=2048, PDL=pdl, num_warps=8,
                                                          launch_pdl=pdl)


HIDDEN, QKV, INTER = 4096, 6144, 14336  # llama3-8b


def make_layers(num_layers, dev):
    def w(n, k):
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    return [dict(qkv=w(QKV, HIDDEN), o=w(HIDDEN, HIDDEN), gu=w(2 * INTER, HIDDEN), down=w(HIDDEN, INTER),
                 n1=torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16),
                 n2=torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)) for _ in range(num_layers)]


def chain(layers, bufs, mode, cfgs, prefetch):
    pdl = mode in ("pdl", "cublas_pdl")  # cublas_pdl: only the Triton norm and silu kernels use PDL
    x, r, h, qkv, o, gu, s, d = (bufs[k] for k in ("x", "r", "h", "qkv", "o", "gu", "s", "d"))

    def lin(a, wt, out, name):
        if mode.startswith("cublas"):
            torch.matmul(a, wt.t(), out=out)
        else:
            linear(a, wt, out, cfgs[name], pdl, prefetch[name])
    for lay in layers:
        add_norm(d, r, lay["n1"], h, pdl)
        lin(h, lay["qkv"], qkv, "qkv")
        lin(qkv[:, :HIDDEN], lay["o"], o, "o")  # stands in for attention's output
        add_norm(o, r, lay["n2"], h, pdl)
        lin(h, lay["gu"], gu, "gu")
        silu_mul(gu, s, pdl)
        lin(s, lay["down"], d, "down")


def graph_time_us(fn, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    args = ap.parse_args()
    log = open(args.out, "w") if args.out else None

    def say(line):
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    bw = []
    for _ in range(3):
        buf.view(2, -1)[1].copy_(buf.view(2, -1)[0])
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        buf.view(2, -1)[1].copy_(buf.view(2, -1)[0])
        b.record()
        torch.cuda.synchronize()
        bw.append(buf.numel() / (a.elapsed_time(b) * 1e-3))
    bandwidth = statistics.median(bw)
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
        f"copy {bandwidth / 1e12:.2f} TB/s (read+write)")
    layers = make_layers(args.layers, dev)
    shapes = dict(qkv=(QKV, HIDDEN), o=(HIDDEN, HIDDEN), gu=(2 * INTER, HIDDEN), down=(HIDDEN, INTER))
    weight_bytes = sum(n * k * 2 for n, k in shapes.values())
    for m in args.batches:
        bm = max(16, triton.next_power_of_2(m))
        if bm <= 32:
            candidates = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=st)
                          for bn in (32, 64) for bk in (128, 256) for st in (3, 4)]
        else:
            candidates = [dict(BLOCK_M=b, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
                          for b in (min(bm, 128),) for bn in (64, 128) for bk in (64, 128)
                          for w, st in ((4, 3), (8, 3))]
        x = torch.randn(m, INTER, device=dev, dtype=torch.bfloat16)
        # correctness and per-shape config choice, one product at a time over all layers' weights
        best = {}
        for name, (n, k) in shapes.items():
            a = x[:, :k]
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            want = F.linear(a, layers[0][name])
            t_cublas = graph_time_us(lambda: [torch.matmul(a, lay[name].t(), out=y) for lay in layers])
            rows = []
            for c in candidates:
                cfg = c
                try:
                    linear(a, layers[0][name], y, cfg, False)
                    err = ((y.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    assert err < 2e-2, f"error {err:.2e}"
                    t = graph_time_us(lambda: [linear(a, lay[name], y, cfg, False) for lay in layers])
                    rows.append((t, cfg))
                except Exception as exc:  # noqa: BLE001 - a config that fails is a result too
                    say(f"M={m} {name} {c} failed: {type(exc).__name__}: {str(exc)[:200]}")
            t_best, cfg_best = min(rows, key=lambda r: r[0])
            best[name] = cfg_best
            floor = n * k * 2 / bandwidth * 1e6
            say(f"M={m:4d} {name:5s} cublas {t_cublas / len(layers):7.1f} us  triton best {t_best / len(layers):7.1f} us "
                f"({cfg_best['BLOCK_M']}/{cfg_best['BLOCK_N']}x{cfg_best['BLOCK_K']} w{cfg_best['num_warps']} s{cfg_best['num_stages']})  floor {floor:6.1f} us")
        bufs = dict(x=x, r=torch.zeros(m, HIDDEN, device=dev, dtype=torch.bfloat16),
                    h=torch.empty(m, HIDDEN, device=dev, dtype=torch.bfloat16),
                    qkv=torch.empty(m, QKV, device=dev, dtype=torch.bfloat16),
                    o=torch.empty(m, HIDDEN, device=dev, dtype=torch.bfloat16),
                    gu=torch.empty(m, 2 * INTER, device=dev, dtype=torch.bfloat16),
                    s=torch.empty(m, INTER, device=dev, dtype=torch.bfloat16),
                    d=torch.zeros(m, HIDDEN, device=dev, dtype=torch.bfloat16))
        # the three chains give the same numbers (bf16 rounding apart)
        outs = {}
        for mode in ("cublas", "triton", "pdl"):
            bufs["r"].zero_()
            bufs["d"].copy_(x[:, :HIDDEN])
            chain(layers[:2], bufs, mode, best, dict(qkv=0, o=0, gu=0, down=0))
            torch.cuda.synchronize()
            outs[mode] = bufs["r"].float().clone()
        for mode in ("triton", "pdl"):
            err = ((outs[mode] - outs["cublas"]).abs().max() / outs["cublas"].abs().max()).item()
            say(f"M={m:4d} chain {mode} vs cublas: max rel err {err:.2e}")
        floor_layer = weight_bytes / bandwidth * 1e6
        variants = [("cublas", {}), ("cublas_pdl", {}), ("triton", {}), ("pdl", dict(qkv=0, o=0, gu=0, down=0)),
                    ("pdl", dict(qkv=1024, o=1024, gu=1024, down=1024)),
                    ("pdl", dict(qkv=4096, o=4096, gu=2048, down=4096))]
        for mode, pre in variants:
            try:
                t = graph_time_us(lambda: chain(layers, bufs, mode, best, pre or dict(qkv=0, o=0, gu=0, down=0)))
                per = t / len(layers)
                say(f"M={m:4d} chain {mode:10s} prefetch {str(pre or '-'):48s} {per:7.1f} us a layer, "
                    f"{floor_layer / per * 100:5.1f}% of the weights' floor ({floor_layer:.1f} us)")
            except Exception as exc:  # noqa: BLE001
                say(f"M={m} chain {mode} {pre} failed: {type(exc).__name__}: {str(exc)[:300]}")
    if log:
        log.close()


if __name__ == "__main__":
    sys.exit(main())

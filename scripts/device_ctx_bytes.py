"""Probe: how close can a decode step's paged own-key read get to copy bandwidth?

The relay step's paged context kernel reads each row's own keys through the block table
at about 3.1-3.3 TB/s in jobs (docs/benchmarks.md, fourteenth session), where the
baseline's contiguous prefix streams at copy bandwidth. This separates what the memory
access pattern costs from what the kernel's work costs. Graph-replayed, L2 flushed, the
same K/V bytes read by:
  ctx           the paged context kernel as relay's overlapped step launches it (fp32 partial)
  read/h1xN     a kernel that only reads the same pages (program per sequence and KV head,
                N-key tiles through the block table, as the context kernel walks them)
  read/h8x16    one program per sequence reading all KV heads of a page at once (2 KiB
                contiguous per token instead of 256 B pieces)
each over a shuffled block table (a fragmented cache, as build_step makes) and a
sequential one (each sequence's pages in order), beside the copy bandwidth relay bench
measures.

    python scripts/device_ctx_bytes.py --model llama3-8b --batch 256 --own 300 --out $OUT/ctx_bytes.log
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.triton_context_attention import paged_attention, paged_config  # noqa: E402
from relaycli.bench.kernels import build_step  # noqa: E402
from relaycli.bench.roofline import measure_ceilings  # noqa: E402
from scripts.device_ncu import HEADS, graph_us  # noqa: E402


@triton.jit
def _read_pages(kc, vc, bt, lens, out, stride_kb, stride_kt, stride_bt,
                PAGE: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr):
    """Sum of a sequence's own K and V over W = (heads per program) x D contiguous elements a token."""
    seq = tl.program_id(0)
    part = tl.program_id(1)
    n = tl.load(lens + seq)
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, W)
    acc = tl.zeros([BLOCK_N, W], tl.float32)
    for start in range(0, n, BLOCK_N):
        j = start + offs_n
        m = j < n
        blk = tl.load(bt + seq * stride_bt + j // PAGE, mask=m, other=0).to(tl.int64)
        off = blk * stride_kb + (j % PAGE) * stride_kt + part * W
        k = tl.load(kc + off[:, None] + offs_w[None, :], mask=m[:, None], other=0.0)
        v = tl.load(vc + off[:, None] + offs_w[None, :], mask=m[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out + seq * HEADS + part, tl.sum(acc))


def read_pages(k_cache, v_cache, meta, heads_per_program: int, block_n: int, num_warps: int, stages: int):
    """out [B, Hkv // heads_per_program] fp32; launches _read_pages over meta's rows."""
    _, page, hkv, d = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and hkv % heads_per_program == 0
    parts = hkv // heads_per_program
    b = meta.context_lens.shape[0]
    out = torch.empty((b, parts), device=k_cache.device, dtype=torch.float32)

    def run():
        _read_pages[(b, parts)](k_cache, v_cache, meta.block_tables, meta.context_lens, out,
                                k_cache.stride(0), k_cache.stride(1), meta.block_tables.stride(0),
                                PAGE=page, W=heads_per_program * d, BLOCK_N=block_n, HEADS=parts,
                                num_warps=num_warps, num_stages=stages)
    return run, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(HEADS), default="llama3-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--own", default="300,128", help="own keys a row (every row), comma-separated cases")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hq, hkv, d = HEADS[args.model]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    lines = []

    def say(s):
        print(s, flush=True)
        lines.append(s)

    ceil = measure_ceilings(dev, torch.bfloat16)
    say(f"copy bandwidth {ceil.bandwidth / 1e12:.2f} TB/s (read + write of a 1 GiB copy, as relay bench measures it)")
    for own in (int(x) for x in args.own.split(",")):
        q, k_cache, v_cache, _, meta = build_step(hq, hkv, d, args.batch, 0, own, dev, torch.bfloat16, gen)
        nbytes = 2 * args.batch * own * hkv * d * 2  # K and V, bf16
        tables = {"shuffled": meta.block_tables,
                  "sequential": torch.arange(meta.block_tables.numel(), device=dev, dtype=torch.int32)
                  .view_as(meta.block_tables)}
        say(f"{args.model} B={args.batch} own={own}: {nbytes / 1e6:.1f} MB of own K/V a layer")
        cfg = paged_config(hq // hkv, d, dev, keys=own, num_programs=args.batch * hkv)
        out = torch.empty((1,) + tuple(q.shape), dtype=torch.float32, device=dev)
        lse = torch.empty((1,) + tuple(q.shape[:2]), dtype=torch.float32, device=dev)
        ones_k, ones_v = torch.ones_like(k_cache), torch.ones_like(v_cache)  # exact sums: a missed tile shows
        for tname, table in tables.items():
            m = dataclasses.replace(meta, block_tables=table, _cache={})
            t = graph_us(lambda: paged_attention(q, k_cache, v_cache, m, d ** -0.5, out=out, lse=lse, config=cfg))
            say(f"  {tname:10s} ctx kernel {cfg}: {t:6.1f} us  {nbytes / t / 1e6:.2f} TB/s")
            for hpp, bn, warps, stages in ((1, 32, 2, 2), (1, 32, 2, 3), (1, 64, 4, 3), (1, 128, 4, 3),
                                           (8, 16, 8, 2), (8, 16, 8, 3), (8, 32, 8, 3)):
                run, res = read_pages(ones_k, ones_v, m, hpp, bn, warps, stages)
                t = graph_us(run)
                ok = bool((res == 2.0 * own * hpp * d).all())
                say(f"  {tname:10s} read/h{hpp}x{bn} {warps}w {stages}s: {t:6.1f} us  {nbytes / t / 1e6:.2f} TB/s"
                    f"{'' if ok else '  WRONG SUM (a tile was missed)'}")
        del ones_k, ones_v
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""How fast the H200's L2 feeds the SMs, against what a llama3 relay step asks of it.

The warp-specialised system kernel at llama3-8b heads, batch 256, prefix 8,192 has 128
programs (8 KV heads x 8 row blocks of 128 query rows x 2 splits), each reading its half
of its head's K/V (2 MiB): 268 MB from L2 into shared memory in about 58 us, where the
unique bytes from HBM are 33.5 MB. The context step reads another 134 MB. If the L2 cannot
deliver both in the system kernel's time, no placement of the two kernels overlaps them.

Times, graph-replayed (the L2 is left warm on purpose): a kernel that only reads a
buffer that fits in L2 (`.cg` loads, so L1 keeps nothing), over each program's own
slice, several passes; for buffer sizes 8-32 MB and 1-4 programs an SM. Bandwidth =
bytes read / time. Writes l2_probe.json to $OUT.

Usage: python scripts/device_l2_probe.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402



@triton.jit
def _read_kernel(x_ptr, out_ptr, per_program, passes, BLOCK: tl.constexpr):
    """Program p sums x[p * per_program : (p + 1) * per_program] `passes` times."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    offs = tl.arange(0, BLOCK)
    for r in range(passes):
        for start in range(0, per_program, BLOCK):
            acc += tl.load(base + start + offs, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def warm_graph_us(launch, reps: int = 30) -> float:
    """Median of CUDA-event timings of replays of a graph of launch(), the L2 left as the last replay left it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def probe(size_mb: int, per_sm: int, passes: int, dev) -> dict:
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    programs = sms * per_sm
    block = 2048
    per_program = (size_mb << 20) // 2 // programs // block * block
    x = torch.randn(programs * per_program, device=dev, dtype=torch.bfloat16)
    out = torch.empty(programs, device=dev, dtype=torch.float32)

    def launch():
        _read_kernel[(programs,)](x, out, per_program, passes, BLOCK=block, num_warps=8)
    launch()
    want = x.view(programs, per_program).float().sum(1) * passes
    torch.cuda.synchronize()
    assert torch.allclose(out, want, rtol=1e-2, atol=1e-2 * per_program ** 0.5 * passes), "read kernel sums differ"
    us = warm_graph_us(launch)
    nbytes = x.numel() * 2 * passes
    return dict(size_mb=size_mb, programs_per_sm=per_sm, passes=passes, time_us=us, bytes=nbytes,
                tb_per_s=nbytes / us / 1e6)


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for size_mb in (8, 16, 24, 32):
        for per_sm in (1, 2, 4):
            row = probe(size_mb, per_sm, 8, dev)
            rows.append(row)
            print(f"L2 read, {size_mb:2d} MB buffer x {row['passes']} passes, {per_sm} programs an SM: "
                  f"{row['time_us']:7.1f} us, {row['tb_per_s']:5.2f} TB/s", flush=True)
    hbm = probe(1024, 2, 1, dev)  # far larger than the L2: the same kernel at HBM speed
    rows.append(hbm)
    print(f"HBM read, 1 GB once: {hbm['time_us']:.1f} us, {hbm['tb_per_s']:.2f} TB/s", flush=True)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "l2_probe.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()

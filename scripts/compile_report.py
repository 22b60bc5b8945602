"""What the paged context kernel compiles to on Hopper, without a GPU.

Compiles kernels/triton_context_attention.py's `_paged_kernel` for sm_90 with the
argument specialisation a real launch gets (pointers and strides divisible by 16: without
it the report is wrong, 255 registers, spills and scalar loads), then prints per tile
config: registers and stack (cuobjdump of the cubin), shared memory, how many K/V tiles
the software pipeline buffers, and the `async_wait` counts of its loop. A K/V buffer
count of 1 with only `num = 0` waits means each tile is loaded after the previous one is
consumed and waited for at once: nothing is in flight while the program computes. The
block-table lookup in front of every K/V load costs the pipeline a stage, so with
Triton 3.6 that is the case for num_stages 2-4 and double buffering starts at 5.

Flags after a config: ":a" sets bt_ahead (the block ids read one iteration early), with
which 3 stages double-buffer K/V; ":s" compiles the relay epilogue (HAS_SYS: the system
partials merged before o is written). Needs a Triton wheel with the NVIDIA backend (its
ptxas and cuobjdump); no CUDA device.
    python scripts/compile_report.py [--configs 32:2:2,32:2:3:a,64:4:5,32:2:2:s] [--group 4] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.triton_context_attention import _paged_kernel  # noqa: E402

INT_POINTERS = ("cu_ptr", "ctx_ptr", "bt_ptr", "grp_ptr")
FP32_POINTERS = ("o_ptr", "lse_ptr", "so_ptr", "sl_ptr")


def signature(fn, consts: dict) -> tuple[dict, dict]:
    """Argument types and the divisibility a launch would specialise on (pointers, strides)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = "*i32" if name in INT_POINTERS else "*fp32" if name in FP32_POINTERS else "*bf16"
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
        if name.endswith("_ptr") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) a thread uses, from the wheel's cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    line = next(l for l in out.splitlines() if "REG:" in l)
    return int(re.search(r"REG:(\d+)", line).group(1)), int(re.search(r"STACK:(\d+)", line).group(1))


def report(block_n: int, num_warps: int, num_stages: int, bt_ahead: bool, has_sys: bool, group: int,
           head_dim: int) -> str:
    consts = dict(G=group, D=head_dim, BLOCK_M=16, BLOCK_N=block_n, PAGE=16, HAS_PREFIX=False, FILTER=False,
                  HEADS_FAST=True, HAS_SYS=has_sys, SYS_UNROLL=4, WRITE_LSE=not has_sys, IEEE=False,
                  BT_AHEAD=bt_ahead)
    sig, attrs = signature(_paged_kernel, consts)
    src = ASTSource(fn=_paged_kernel, signature=sig, attrs=attrs,
                    constexprs={(_paged_kernel.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    regs, stack = resources(k.asm["cubin"])
    ir = k.asm["ttgir"]
    buffers = sorted({int(n) for n in re.findall(rf"memdesc<(\d+)x{block_n}x{head_dim}x", ir)})
    waits = sorted({int(n) for n in re.findall(r"async_wait[^{]*\{num = (\d+)", ir)})
    flags = (" bt_ahead" if bt_ahead else " " * 9) + (" relay epilogue" if has_sys else " " * 15)
    return (f"BLOCK_N {block_n:3d} warps {num_warps} stages {num_stages}{flags}: "
            f"registers {regs:3d} stack {stack:4d} B "
            f"shared {k.metadata.shared / 1024:5.1f} KiB  K/V buffers {buffers}  async_wait num {waits}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="32:2:2,32:2:3,32:2:5,32:2:3:a,64:4:2,64:4:3,64:4:5,64:4:3:a",
                    help="BLOCK_N:num_warps:num_stages[:a][:s], comma-separated (a: bt_ahead, s: relay epilogue)")
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head (llama3-8b: 4)")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, _paged_kernel decode tile (BLOCK_M 16), G={args.group}, "
          f"D={args.head_dim}", flush=True)
    for item in args.configs.split(","):
        fields = item.split(":")
        block_n, warps, stages = map(int, fields[:3])
        flags = fields[3:]
        unknown = set(flags) - {"a", "s"}
        if unknown:
            raise SystemExit(f"unknown flag {sorted(unknown)[0]!r} in {item!r}: use a (bt_ahead) or s (relay epilogue)")
        print(report(block_n, warps, stages, "a" in flags, "s" in flags, args.group, args.head_dim), flush=True)


if __name__ == "__main__":
    main()

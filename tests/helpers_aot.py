"""Compile relay's Triton layer kernels ahead of time for an H100/H200 (sm_90) on any
machine, no GPU needed (Triton ships ptxas), and print which grid-dependency instructions
(programmatic dependent launch) each variant's PTX carries, as JSON.

Run as a script, without TRITON_INTERPRET (under it @triton.jit builds interpreted functions)."""

from __future__ import annotations

import json
import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)


def signature(fn, constexprs: dict, pointers: dict) -> dict:
    """Every argument of fn typed: constexprs, pointers as given, qk_scale fp32, the rest i32."""
    return {name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name == "qk_scale" else "i32")
            for name in fn.arg_names}


def griddep(fn, constexprs: dict, pointers: dict, **options) -> list[str]:
    kernel = triton.compile(ASTSource(fn, signature(fn, constexprs, pointers), constexprs), target=SM90,
                            options=options)
    return sorted({line.split()[0].rstrip(";") for line in kernel.asm["ptx"].splitlines()
                   if line.strip().startswith("griddepcontrol")})


def layer_ops(pdl: bool) -> dict[str, list[str]]:
    """The small kernels between a layer's products (relaycli.kernels.pdl), as the engine launches them."""
    from relaycli.kernels.triton_rms_norm import _add_rms_norm_kernel
    from relaycli.kernels.triton_rope import _rope_kernel
    from relaycli.kernels.triton_silu_mul import _silu_mul_kernel
    bf16 = lambda *names: {name: "*bf16" for name in names}  # noqa: E731
    return {
        "add_rms_norm": griddep(_add_rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=4096, PDL=pdl),
                                bf16("x_ptr", "r_ptr", "w_ptr", "out_ptr", "res_out_ptr"), num_warps=16),
        "rope": griddep(_rope_kernel, dict(HALF=64, BLOCK_HQ=32, BLOCK_HK=8, TO_CACHE=True, PDL=pdl),
                        dict(bf16("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr", "v_ptr", "vo_ptr"),
                             slot_ptr="*i64"), num_warps=8, enable_fp_fusion=False),
        "silu_mul": griddep(_silu_mul_kernel, dict(BLOCK=1024, PDL=pdl), bf16("gu_ptr", "out_ptr"), num_warps=4),
    }


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    print(json.dumps({"layer_ops": layer_ops(False), "layer_ops_pdl": layer_ops(True)}))

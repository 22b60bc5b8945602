"""Compile relay's Triton attention kernels ahead of time for an H100/H200 (sm_90) on any
machine, no GPU needed (Triton ships ptxas), and print which grid-dependency instructions
(programmatic dependent launch) each variant's PTX carries, as JSON.

Run as a script, without TRITON_INTERPRET (under it @triton.jit builds interpreted functions)."""

from __future__ import annotations

import json
import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton_context_attention import _paged_kernel
from kernels.triton_system_attention import _system_kernel

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


def paged(wait_sys: bool) -> list[str]:
    consts = dict(G=4, D=128, BLOCK_M=16, BLOCK_N=32, PAGE=16, HAS_PREFIX=False, FILTER=False, HEADS_FAST=True,
                  HAS_SYS=True, SYS_UNROLL=4, WRITE_LSE=False, IEEE=False, BT_AHEAD=False, WAIT_SYS=wait_sys)
    ptrs = {name: "*bf16" for name in ("q_ptr", "kc_ptr", "vc_ptr", "kp_ptr", "vp_ptr", "o_ptr")}
    ptrs.update({name: "*fp32" for name in ("lse_ptr", "so_ptr", "sl_ptr")})
    ptrs.update({name: "*i32" for name in ("cu_ptr", "ctx_ptr", "bt_ptr", "grp_ptr")})
    return griddep(_paged_kernel, consts, ptrs, num_warps=2, num_stages=2)


def system(trigger: bool) -> list[str]:
    consts = dict(G=4, D=128, BLOCK_M=64, BLOCK_N=64, HAS_ROWS=True, IEEE=False, TMA=False, TRIGGER=trigger)
    ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", rows_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
    return griddep(_system_kernel, consts, ptrs, num_warps=4, num_stages=3)


def layer_ops(pdl: bool) -> dict[str, list[str]]:
    """The small kernels between a layer's products (kernels.pdl), as the engine launches them."""
    from kernels.triton_rms_norm import _add_rms_norm_kernel
    from kernels.triton_rope import _rope_kernel
    from kernels.triton_silu_mul import _silu_mul_kernel
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
    print(json.dumps({"paged": paged(False), "paged_wait_sys": paged(True),
                      "system": system(False), "system_trigger": system(True),
                      "layer_ops": layer_ops(False), "layer_ops_pdl": layer_ops(True)}))

"""Launch tiles of the attention kernels: frozen values that a plan carries and a launcher executes.

kernels/planner.py picks them (through the arithmetic of kernels/triton_plan.py); the
launchers read their fields and choose nothing. Frozen and hashable, so a plan that holds
them can key a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    """A Triton program's tile: BLOCK_M query rows x BLOCK_N keys, its warps and pipeline depth.

    per_sm: programs an SM the split plan counts on (planning only, never launched).
    System kernel (kernels/triton_system_attention.py): tma: K/V fetched by tensor
    descriptors; gluon: the Gluon kernel (kernels/gluon_system_attention.py); ws: its
    warp-specialised program. None in tma or gluon: in a CUDA graph's steps only, whose
    descriptors are built once; the planner turns None into a yes or a no for its step.
    Paged kernel (kernels/triton_context_attention.py): bt_ahead: block ids read a tile
    ahead; maxnreg: the launch's register cap; heads_fast: neighbouring programs take
    neighbouring KV heads (else neighbouring sequences, which then share a prefix in L2).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    per_sm: int = 1
    tma: bool | None = False
    gluon: bool | None = False
    ws: bool = False
    bt_ahead: bool = False
    maxnreg: int | None = None
    heads_fast: bool = True

    def launch(self) -> dict:
        """The Triton launch keywords of this tile."""
        out = dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            out["maxnreg"] = self.maxnreg
        return out

    def replace(self, **changes) -> "Tile":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MergeTile:
    """The merge kernel's launch: heads a program (a power of two), partials loaded at once
    (the same bits for any), and whether it is a programmatic dependent of the kernel before
    it (sm_90, kernels/pdl.py)."""

    block_h: int
    unroll: int
    pdl: bool = False


# Registers a thread of the fused decode kernel's roles (kernels/gluon_fused_relay.py): the
# prefix consumers' and the own-key warpgroup's (the TMA warps take 24; the launch caps 128).
FUSED_SYS_REGS = 176
FUSED_CTX_REGS = 136


@dataclass(frozen=True)
class FusedTile:
    """The fused decode kernel's prefix tile and rings: block_n-key prefix tiles in a ring of
    `stages`, a ring of ctx_tiles own-key [64, D] slots, Q of the prefix consumers in shared
    memory (q_smem) or registers, and the register split of its roles."""

    block_n: int = 64
    stages: int = 3
    ctx_tiles: int = 4
    q_smem: bool = False
    sys_regs: int = FUSED_SYS_REGS
    ctx_regs: int = FUSED_CTX_REGS


# Decode-sized system tiles on the GPU. DECODE_TILE: 64 query rows (one warpgroup of wgmma),
# 64-key tiles, 3 stages, two programs an SM. WS_TILE: the warp-specialised Gluon kernel,
# 128 rows in two consumer warpgroups beside a TMA warp, 128-key tiles, 2 stages, one
# program an SM (it claims the whole register file).
DECODE_TILE = Tile(64, 64, 4, 3, per_sm=2, tma=None, gluon=None)
WS_TILE = Tile(128, 128, 4, 2, per_sm=1, tma=None, gluon=None, ws=True)
# The fused kernel's prefix tile where the prefix consumers are its longer role: 128-key
# tiles with Q in shared memory (the consumers then need 216 registers, the own-key
# warpgroup gets 56, and the own-key ring 3 tiles: 219 KiB). docs/kernels.md has the numbers.
FUSED_WIDE_TILE = FusedTile(block_n=128, stages=2, ctx_tiles=3, q_smem=True, sys_regs=216, ctx_regs=56)


def fit_smem(tile: Tile, head_dim: int, elem: int, budget: int = 180 * 1024) -> Tile:
    """Shrink block_n, then the pipeline depth, until Q + stages * (K + V) tiles fit shared memory."""
    def need(t: Tile) -> int:
        return (t.block_m + t.num_stages * 2 * t.block_n) * head_dim * elem

    while need(tile) > budget and tile.block_n > 16:
        tile = tile.replace(block_n=tile.block_n // 2)
    while need(tile) > budget and tile.num_stages > 1:
        tile = tile.replace(num_stages=tile.num_stages - 1)
    return tile

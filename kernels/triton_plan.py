"""The planner's arithmetic: tile shapes and split-K counts of the Triton attention kernels.

Plain arithmetic on shapes and device properties (no kernels here, no choice of path):
kernels/planner.py calls it to fill in a plan's tiles and splits. It imports no Triton: the
planner loads with the engine, before the CPU tests set TRITON_INTERPRET.
"""

from __future__ import annotations

import functools
import math

import torch

from relaycli.kernels.tiles import DECODE_TILE, FUSED_WIDE_TILE, WS_TILE, FusedTile, Tile, fit_smem


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill; a small number under the interpreter so splits get exercised."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def split_plan(num_keys: int, programs: int, device: torch.device, block_n: int,
               min_keys: int = 256, per_sm: int = 1) -> tuple[int, int]:
    """(num_splits, keys_per_split) for `programs` independent tiles over num_keys keys.

    Time is modelled as waves * keys per program, waves = ceil(programs * splits / slots)
    with per_sm resident programs per multiprocessor, plus 64 keys' worth per split for
    writing and merging its partial: a batch that already fills the chip stays unsplit.
    Only powers of two are chosen: the relay epilogue unrolls over the system splits, so
    each distinct count is another compiled kernel, and a job's prefill steps (all
    sizes) would otherwise compile new variants while it runs.
    """
    slots = num_sms(device) * per_sm
    most = max(1, num_keys // min_keys) if programs < slots else 1
    candidates = [1 << i for i in range(most.bit_length()) if 1 << i <= most]
    cost = [(math.ceil(programs * s / slots) * math.ceil(num_keys / s / block_n) * block_n + 64 * s, s)
            for s in candidates]
    num_splits = min(cost)[1]
    num_splits = max(1, min(num_splits, max(num_keys, 1)))
    per = math.ceil(max(num_keys, 1) / num_splits)
    per = math.ceil(per / block_n) * block_n
    return num_splits, per


# bf16 matrix work a byte of HBM traffic pays for on the H200: its matmul rate over its copy
# bandwidth, both measured with every kernel table (docs/kernels.md has the ceilings)
RIDGE_FLOPS_PER_BYTE = 185


def resident_splits(programs: int, num_keys: int, block_m: int, head_dim: int, sys_bytes: float,
                    ctx_bytes: float, device: torch.device) -> int | None:
    """Split count that lets an overlapped decode step run its system kernel beside the context.

    programs: the system kernel's row tiles x KV heads before any split. Planned for two
    programs an SM, the system kernel's programs fill each SM's shared memory and the
    context kernel's wait behind them: the two run one after the other. With at most one
    an SM, context programs fill the rest of every SM, so the system kernel costs nothing
    while its programs finish before the context does. Returns the fewest splits (a power
    of two, at most one program an SM) whose program does its matrix work, at one SM's
    share of the matmul rate, in less time than the context step reads its bytes; None
    when none does, or when the system step is bound by bytes (it would compete with the
    context for the same bandwidth). Measured on the H200; docs/kernels.md has the numbers.
    """
    slots = num_sms(device)
    flops = 4.0 * programs * block_m * num_keys * head_dim
    if not matrix_bound(flops, sys_bytes):
        return None
    splits = 1
    while programs * splits <= slots:
        if flops / (programs * splits) * slots / RIDGE_FLOPS_PER_BYTE < ctx_bytes:
            return splits
        splits *= 2
    return None


def matrix_bound(flops: float, num_bytes: float) -> bool:
    """Whether work of these flops and HBM bytes takes longer at the matmul rate than at copy bandwidth."""
    return flops / RIDGE_FLOPS_PER_BYTE > num_bytes


def merge_unroll(programs: int, device: torch.device) -> int:
    """Splits the merge kernel loads at once (the bits are the same for any count).

    programs: the merge grid's, rows x head blocks (merge_block_h's). A grid that leaves
    most multiprocessors idle (a job's tail) waits a memory latency per split unless
    several are in flight; a full one hides that latency behind its other programs, and
    there the one-at-a-time kernel (fewer registers) is as fast. Measured on the H200 in
    whole jobs; docs/kernels.md has the numbers.
    """
    return 4 if programs <= 2 * num_sms(device) else 1


def merge_row_block_h(num_heads: int, head_dim: int) -> int:
    """Heads a merge program takes where the grid is large: all of a row's (a power of two
    at or above num_heads), up to 2,048 values."""
    return min(1 << max(0, num_heads - 1).bit_length(), max(1, 2048 // head_dim))


def merge_block_h(num_rows: int, num_heads: int, head_dim: int, device: torch.device) -> int:
    """Heads a merge program takes (a power of two): all of a row's, up to 2,048 values, as
    long as the grid, rows x head blocks, keeps 3 or more programs an SM; fewer where it
    would not, down to 2. A small grid of large programs leaves each
    SM one program that waits an L2 round trip per split; more, smaller programs keep more
    loads in flight (the same bits for any block: each value's fold is the same). Measured
    on the H200; docs/kernels.md has the numbers.
    """
    block_h = merge_row_block_h(num_heads, head_dim)
    while block_h > 2 and num_rows * -(-num_heads // block_h) < 3 * num_sms(device):
        block_h //= 2
    return block_h


PREFILL_ROWS = 4096  # from here on the problem is prefill-sized: large tiles pay


def ws_pays(rows: int, kv_heads: int, sms: int) -> bool:
    """Whether the warp-specialised tile beats DECODE_TILE: its grid before any split,
    ceil(rows / 128) x kv_heads programs, covers at least a quarter of the SMs; a smaller
    grid does not earn back the warp-specialised program's larger start-up cost. Measured
    on the H200; docs/kernels.md has the numbers."""
    return 4 * -(-rows // WS_TILE.block_m) * kv_heads >= sms


def system_config(rows: int, head_dim: int, device: torch.device, elem: int = 2, kv_heads: int = 1) -> Tile:
    """Tile shape for a [rows, D] x [S, D]^T problem (rows: the queries of one KV head, x G).

    On the GPU, decode-sized: DECODE_TILE (64 rows, K/V fetched by TMA), or on Hopper
    WS_TILE where ws_pays; gluon None runs it in a CUDA graph's steps as
    kernels/gluon_system_attention.py (the softmax beside the tensor cores). Prefill-sized
    (PREFILL_ROWS rows or more): 128 x 128 tiles, 8 warps, 3 stages, TMA even eagerly (a
    descriptor is cheap next to a kernel of milliseconds). That tile needs about 224 KiB of
    shared memory, so it is kept only where the device has it. Measured on the H200;
    docs/kernels.md has the numbers.
    """
    if device.type == "cuda":
        if rows >= PREFILL_ROWS:
            tile = Tile(128, 128, 8, 3, per_sm=1, tma=True)
            return fit_smem(tile, head_dim, elem, smem_per_block(device))
        tile = WS_TILE if is_sm90(device) and ws_pays(rows, kv_heads, num_sms(device)) else DECODE_TILE
    else:  # the interpreter: small tiles keep the split and tail paths busy
        block_m = 64 if rows > 32 else 32 if rows > 16 else 16
        tile = Tile(block_m, 64, 4, 3, per_sm=2)
    return fit_smem(tile, head_dim, elem)


def grouped_config(device: torch.device) -> Tile:
    """The grouped system kernel's tile (kernels/triton_grouped_system.py): decode-sized on
    the GPU (64 query rows, 64-key tiles); small under the interpreter, so that the tests'
    tiles straddle groups."""
    if device.type == "cuda":
        return Tile(64, 64, 4, 2, per_sm=2)
    return Tile(16, 32, 4, 1, per_sm=2)


def grouped_splits(num_rows: int, num_heads: int, num_kv_heads: int, max_keys: int, device: torch.device) -> int:
    """The grouped system kernel's split count for num_rows rows of a step whose longest
    prefix has max_keys keys: split_plan over its row tiles, as for one prefix of that length
    (a step's rows split among groups give it as many tiles, and each reads its group's keys)."""
    tile = grouped_config(device)
    programs = -(-num_rows * (num_heads // num_kv_heads) // tile.block_m) * num_kv_heads
    return split_plan(max_keys, programs, device, tile.block_n, per_sm=tile.per_sm)[0]


# Own keys a cache block holds on the GPU: the fused decode step (kernels/gluon_fused_relay.py)
# reads one block a 64-key chunk, by one TMA each for its K and V. Elsewhere 16 (the CPU's
# kernels gather key by key; a smaller block wastes less of a small cache). The other CUDA
# kernels address any block size key by key and take the same time on 64-key blocks as on
# 16-key ones (measured on the H200; docs/kernels.md has the numbers).
FUSED_CHUNK = 64  # own keys a chunk of the fused decode step: one cache block, one TMA box
CUDA_BLOCK_SIZE = FUSED_CHUNK
CPU_BLOCK_SIZE = 16


def default_block_size(device: torch.device) -> int:
    """The paged KV cache's keys a block where the engine's config leaves it open."""
    return CUDA_BLOCK_SIZE if device.type == "cuda" else CPU_BLOCK_SIZE


def fused_decode_plan(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, elem: int, block_size: int,
                      device: torch.device, prefix_tokens: int, num_context_tokens: int,
                      max_context_len: int) -> int | None:
    """System splits of relay's fused decode step (kernels/gluon_fused_relay.py: the own keys
    inside the warp-specialised system program) for num_seqs rows, all behind one prefix of
    prefix_tokens, with num_context_tokens own keys in all and none longer than
    max_context_len (a decode graph's context bucket); None where that kernel cannot run
    (not sm_90, cache blocks other than 64 keys, not 16-bit, head_dim not 64 or 128, more
    than 8 query heads a KV head, no prefix) or does not pay.

    A program's own-key warpgroup attends its requests' own keys one 64-key chunk after
    another while its prefix consumers take their share of the prefix, 64 keys a tile. It
    pays where a program's own chunks are at most twice its prefix tiles, both at the mean
    length (the engine deals a fused step's rows so that its programs' loads are even:
    relaycli.engine.cuda_graph.DecodeGraphs.deal) and for the longest row allowed
    (max_context_len), which one program must take whole. Past that ratio the overlapped
    step's context kernel, running beside a resident system kernel, reads the own keys
    faster than one own-key warpgroup an SM; the ratio gives up two small wins past it to
    keep out that loss. Without the dealing, under ragged lengths the program with the
    longest rows sets each step's time. Measured on the H200, with equal and with ragged
    own lengths; docs/kernels.md has the numbers.

    Splits: the most (a power of two) that keep the grid within one program an SM (the
    program holds an SM's registers), and at least 256 prefix keys a split.
    """
    group = num_heads // num_kv_heads
    if not (is_sm90(device) and block_size == FUSED_CHUNK and elem == 2 and head_dim in (64, 128)
            and 1 <= group <= 8 and prefix_tokens > 0 and num_seqs > 0):
        return None
    rows_per_tile = -(-128 // group)  # requests a program takes at most
    row_tiles = -(-num_seqs * group // 128)
    programs, splits = row_tiles * num_kv_heads, 1
    while programs * splits * 2 <= num_sms(device) and prefix_tokens >= 2 * splits * 256:
        splits *= 2
    requests = -(-min(num_seqs, rows_per_tile) // splits)
    own_chunks = requests * max(1, -(-num_context_tokens // (num_seqs * FUSED_CHUNK)))
    prefix_tiles = -(-prefix_tokens // (splits * 64))  # in 64-key tiles, whatever the kernel's
    longest_chunks = -(-max_context_len // FUSED_CHUNK)
    return splits if max(own_chunks, longest_chunks) <= 2 * prefix_tiles else None


FUSED_WIDE_MIN_ROW_TILES = 4


def fused_tile(num_seqs: int, num_heads: int, num_kv_heads: int) -> FusedTile:
    """The fused decode kernel's tile (kernels/gluon_fused_relay.py) for a step of num_seqs
    rows: FUSED_WIDE_TILE where a KV head has FUSED_WIDE_MIN_ROW_TILES row tiles of 128 query
    rows or more (the prefix work per program is then the longer role), else FusedTile's
    defaults (64-key tiles, Q in registers, a 4-tile own-key ring). With fewer row tiles a KV
    head the own keys are the longer role, and 64-key tiles are as fast or faster. Measured
    on the H200; docs/kernels.md has the numbers."""
    row_tiles = -(-num_seqs * (num_heads // num_kv_heads) // 128)
    return FUSED_WIDE_TILE if row_tiles >= FUSED_WIDE_MIN_ROW_TILES else FusedTile()


@functools.lru_cache(maxsize=64)
def fused_program_rows(num_rows: int, group: int, num_splits: int) -> tuple[tuple[int, ...], ...]:
    """The rows whose own keys each program (m, split) of the fused decode kernel attends,
    for every KV head alike: kernels/gluon_fused_relay.py's mapping (the rows whose first
    query row r * group is among program m's 128, those at index split modulo num_splits
    within them), one tuple of rows a program that has any, in (m, split) order. A pure
    function of its arguments, cached: a decode graph deals its rows by it every step."""
    bins: dict[tuple[int, int], list[int]] = {}
    for r in range(num_rows):
        m = r * group // 128
        bins.setdefault((m, (r - -(-128 * m // group)) % num_splits), []).append(r)
    return tuple(tuple(rows) for rows in bins.values())


# The full-grid 32-key decode tile's register cap: uncapped it takes 165 registers a thread,
# six programs an SM; at 128, eight. Measured on the H200 (lower caps gain nothing more);
# docs/kernels.md has the numbers.
MAX_REGISTERS_SHORT_TILE = 128
# Decode key ranges up to this many keys take the 32-key tile (a graph plans for its context
# bucket, the next of 256, 1024, 4096 above the longest own context).
SHORT_TILE_KEYS = 512


def paged_config(rows_per_seq: int, head_dim: int, device: torch.device, elem: int = 2,
                 keys: int = 1 << 30, num_programs: int | None = None) -> Tile:
    """Row tile from q_len*G (>= 16 for tl.dot); decode tiles stay small so many programs fit an SM.

    A decode program over few keys (relay's own keys) is latency-bound: 32-key tiles and
    2 warps let more programs share an SM. Long key ranges (the baseline) stream best with
    64-key tiles and 4 warps.

    num_programs: sequences x KV heads of the launch, before any split (None: as many as
    fill the chip). At most two of them per multiprocessor is a job's tail: no other
    programs hide a tile's load, so the decode tiles read their block ids a tile ahead
    (bt_ahead) and keep the next K/V tile in flight at 3 stages. Fuller grids keep 2
    stages: read-ahead takes the 64-key tile from 38 to 70 KiB of shared memory, three
    programs an SM instead of four (per_sm, which the split plan uses), and there other
    programs hide the latency anyway. Relay's context step passes num_programs
    (paged_attention's read_ahead); the baseline's launches pass None. On CUDA the
    full-grid 32-key tile carries a register cap (maxnreg, a launch option), so more of its
    programs share an SM. Measured on the H200; docs/kernels.md has the numbers.
    """
    block_m = max(16, min(128 if device.type == "cuda" else 32, 1 << max(0, rows_per_seq - 1).bit_length()))
    ahead = block_m <= 16 and num_programs is not None and num_programs <= 2 * num_sms(device)
    if block_m >= 128:
        tile = Tile(block_m, 64, 8, 3, per_sm=1)
    elif block_m <= 16 and keys <= SHORT_TILE_KEYS:  # six programs an SM uncapped, with or without read-ahead
        tile = Tile(block_m, 32, 2, 3 if ahead else 2, per_sm=4)
        if device.type == "cuda" and not ahead:
            # 165 registers a thread bind this tile to six programs an SM; capped at 128
            # eight fit, and a full grid of short contexts keeps more loads in flight
            tile = tile.replace(maxnreg=MAX_REGISTERS_SHORT_TILE)
    elif ahead:
        tile = Tile(block_m, 64, 4, 3, per_sm=3)
    else:
        tile = Tile(block_m, 64, 4, 2, per_sm=4)
    if ahead:
        tile = tile.replace(bt_ahead=True)
    return fit_smem(tile, head_dim, elem)


def smem_per_block(device: torch.device) -> int:
    """Shared memory one program may claim, less a margin for the compiler's own use."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 180 * 1024 + 4096) - 3 * 1024


def is_hopper_or_newer(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or newer (TMA descriptors, griddepcontrol)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def is_sm90(device: torch.device) -> bool:
    """An NVIDIA Hopper GPU, compute capability 9.0 exactly: what the Gluon system kernels
    (wgmma, Hopper TMA) are written for."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) == (9, 0)


def tma_ok(t: torch.Tensor) -> bool:
    """A host tensor descriptor needs NVIDIA Hopper or newer (or the interpreter), 16-byte alignment."""
    if t.is_cuda and not is_hopper_or_newer(t.device):
        return False
    return t.is_contiguous() and t.data_ptr() % 16 == 0

"""Next-token draws for a whole batch in two Triton launches: no sort, no per-row launches.

The first kernel finds each row's threshold (one program per row; rows that keep every
token exit at once), the second draws (programs of `chunk` tokens, which meet in one
atomic max per row). Temperature scales the row (x / T, rounded as PyTorch divides).
Top-k and top-p become one threshold on the scaled logits: a token is kept when it is at
least as large as

- the k-th largest value (top-k; ties with it are kept), and
- the largest value tau whose tokens {x >= tau} hold at least top_p of the top-k set's
  probability (top-p: the smallest head of the sorted row that reaches top_p).

The threshold is found without sorting. One pass takes the row's max and softmax
normaliser. Then a search narrows an interval that holds the threshold: each pass asks,
for PROBES candidate thresholds at once, how many tokens (or how much probability) lie at
or above each. Candidates are evenly spaced values while the interval is wide, and evenly
spaced fp32 order keys (int32 with the floats' order) once it is a few thousand fp32
steps wide, so the search ends exactly. As soon as at most the scratch width of tokens
(4,096) lie in the interval, they are copied out and the remaining passes read only them:
for a language model's peaked rows that is after one or two passes over the row.
The draw is the Gumbel-max trick over the kept tokens, argmax(x + g), g = -log(-log u),
with u from Philox keyed by the row's seed and the token index (one Philox call serves
four neighbouring tokens), so a row's token depends
only on its logits, its options and its seed. Greedy rows (T = 0) take the plain argmax
(first index among equal maxima, as torch.argmax).

Launch: `sample(logits, params)`; params [B, 4] int64 per row: seed, top_k (>= V: off),
fp32 bits of the temperature (0: greedy), fp32 bits of top_p (>= 1: off); see
`pack_params`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)


@triton.jit
def _order_key(x):
    """fp32 -> int64 with the same order (for non-NaN values)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _key_value(key):
    """The fp32 whose _order_key is key (int64 in the int32 range)."""
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _raw_block(row_ptr, start, length, BLOCK: tl.constexpr):
    """Values start .. start+BLOCK-1 of a row in fp32 (logits may be bf16/fp16); -inf past its length."""
    cols = start + tl.arange(0, BLOCK)
    return tl.load(row_ptr + cols, mask=cols < length, other=-float("inf")).to(tl.float32)


@triton.jit
def _scaled_block(row_ptr, start, length, divisor, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    mask = cols < length
    return tl.math.div_rn(_raw_block(row_ptr, start, length, BLOCK), divisor), cols, mask


@triton.jit
def _search(src_ptr, length, divisor, lo, hi, count_lo, row_max, target, stop_count,
            USE_MASS: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """Narrow [lo, hi] (order keys) towards the largest t with  count(x >= t) >= target
    (USE_MASS false) or  sum(exp(x - row_max) over x >= t) >= target  (USE_MASS true), over
    the `length` values at src_ptr (divided by `divisor`). The condition holds at lo;
    count_lo = count(x >= lo). Stops when lo == hi, or as soon as count_lo <= stop_count
    (then the caller copies the values >= lo out and goes on over those).

    Each pass tests PROBES thresholds at once: evenly spaced values while the interval is
    wide (the kept set's edge is found in a few passes whatever the values' magnitude),
    evenly spaced keys once it is a few thousand fp32 steps wide (exact termination).
    Returns (lo, hi, count_lo).
    """
    probe_index = tl.arange(0, PROBES).to(tl.int64)
    while (lo < hi) & (count_lo > stop_count):
        lo_value, hi_value = _key_value(lo), _key_value(hi)
        by_value = _order_key(lo_value + (hi_value - lo_value) * ((probe_index + 1).to(tl.float32) / (PROBES + 1)))
        by_key = lo + (hi - lo + PROBES) // (PROBES + 1) * (probe_index + 1)
        probes = tl.where(hi - lo > 4096, by_value, by_key)
        probes = tl.minimum(tl.maximum(probes, lo + 1), hi)
        probe_values = _key_value(probes)  # compare floats: the order is the keys' order
        counts = tl.zeros((BLOCK, PROBES), dtype=tl.float32)
        masses = tl.zeros((BLOCK, PROBES), dtype=tl.float32)
        # One program reads a whole row, so the next block's load is issued before this
        # block is counted: otherwise each pass waits out a memory latency per block.
        ahead = _raw_block(src_ptr, 0, length, BLOCK)
        for start in range(0, length, BLOCK):
            x = tl.math.div_rn(ahead, divisor)
            ahead = _raw_block(src_ptr, start + BLOCK, length, BLOCK)
            above = x[:, None] >= probe_values[None, :]  # false past the end (x = -inf)
            counts += above.to(tl.float32)
            if USE_MASS:
                masses += tl.where(above, tl.exp2((x - row_max) * LOG2E)[:, None], 0.0)
        count = tl.sum(counts, axis=0)
        if USE_MASS:
            holds = tl.sum(masses, axis=0) >= target
        else:
            holds = count >= target
        new_lo = tl.max(tl.where(holds, probes, lo), axis=0)
        hi = tl.min(tl.where(holds, hi, probes - 1), axis=0)
        # (equal probes have equal counts)
        count_lo = tl.where(new_lo == lo, count_lo, tl.max(tl.where(probes == new_lo, count, 0.0), axis=0))
        lo = new_lo
    return lo, hi, count_lo


@triton.jit
def _copy_out(row_ptr, vocab, divisor, scratch_row, lo, BLOCK: tl.constexpr):
    """Copy the row's values >= _key_value(lo) to scratch_row, in order."""
    threshold = _key_value(lo)
    written = 0
    for start in range(0, vocab, BLOCK):
        x, cols, mask = _scaled_block(row_ptr, start, vocab, divisor, BLOCK)
        inside = x >= threshold
        tl.store(scratch_row + written + tl.cumsum(inside.to(tl.int32), axis=0) - 1, x, mask=inside)
        written += tl.sum(inside.to(tl.int32), axis=0)


@triton.jit
def _mass_from(src_ptr, length, divisor, threshold, row_max, BLOCK: tl.constexpr):
    """sum(exp(x - row_max)) over the values x >= threshold at src_ptr (divided by divisor)."""
    total = tl.zeros((), tl.float32)
    for start in range(0, length, BLOCK):
        x, cols, mask = _scaled_block(src_ptr, start, length, divisor, BLOCK)
        total += tl.sum(tl.where(x >= threshold, tl.exp2((x - row_max) * LOG2E), 0.0))
    return total


@triton.jit
def _settle(row_ptr, vocab, divisor, scratch_row, lo, hi, count_lo, in_scratch, num_scratch, row_max, target,
            SCRATCH: tl.constexpr, USE_MASS: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """_search to the end: over the whole row until at most SCRATCH values remain, then
    over a copy of those. in_scratch (int32 0/1): the values that matter are already there.
    Returns (threshold key, count of values >= it, in_scratch, num_scratch)."""
    if in_scratch == 0:
        lo, hi, count_lo = _search(row_ptr, vocab, divisor, lo, hi, count_lo, row_max, target, SCRATCH,
                                   USE_MASS=USE_MASS, BLOCK=BLOCK, PROBES=PROBES)
        if lo < hi:
            _copy_out(row_ptr, vocab, divisor, scratch_row, lo, BLOCK=BLOCK)
            in_scratch = tl.full((), 1, tl.int32)
            num_scratch = count_lo.to(tl.int32)
    if lo < hi:
        lo, hi, count_lo = _search(scratch_row, num_scratch, 1.0, lo, hi, count_lo, row_max, target, 0,
                                   USE_MASS=USE_MASS, BLOCK=BLOCK, PROBES=PROBES)
    return lo, count_lo, in_scratch, num_scratch


@triton.jit
def _threshold_kernel(logits_ptr, stride_row, params_ptr, scratch_ptr, threshold_ptr, best_ptr, vocab,
                      SCRATCH: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """Each row's smallest kept scaled logit (-inf: all kept), one program per row."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    scratch_row = scratch_ptr + row * SCRATCH
    top_k = tl.load(params_ptr + row * 4 + 1)
    temperature = tl.load(params_ptr + row * 4 + 2).to(tl.int32).to(tl.float32, bitcast=True)
    top_p = tl.load(params_ptr + row * 4 + 3).to(tl.int32).to(tl.float32, bitcast=True)
    divisor = tl.where(temperature == 0.0, 1.0, temperature)
    threshold = tl.full((), -float("inf"), tl.float32)
    if (temperature != 0.0) & ((top_k < vocab) | (top_p < 1.0)):
        # The row's max, min and softmax normaliser (running max, rescaled sum).
        row_max = -float("inf")
        row_min = float("inf")
        total = 0.0
        ahead = _raw_block(row_ptr, 0, vocab, BLOCK)
        for start in range(0, vocab, BLOCK):
            x = tl.math.div_rn(ahead, divisor)
            mask = start + tl.arange(0, BLOCK) < vocab
            ahead = _raw_block(row_ptr, start + BLOCK, vocab, BLOCK)  # in flight meanwhile
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            total = total * tl.exp2((row_max - new_max) * LOG2E) + tl.sum(
                tl.exp2((x - new_max) * LOG2E), axis=0)
            row_max = new_max
            row_min = tl.minimum(row_min, tl.min(tl.where(mask, x, float("inf")), axis=0))
        lo = _order_key(row_min)
        hi = _order_key(row_max)
        count_lo = tl.zeros((), tl.float32) + vocab
        in_scratch = tl.zeros((), tl.int32)
        num_scratch = tl.zeros((), tl.int32)
        if top_k < vocab:
            lo, count_lo, in_scratch, num_scratch = _settle(
                row_ptr, vocab, divisor, scratch_row, lo, hi, count_lo, in_scratch, num_scratch, row_max,
                top_k.to(tl.float32), SCRATCH=SCRATCH, USE_MASS=False, BLOCK=BLOCK, PROBES=PROBES)
            threshold = _key_value(lo)
            # top-p is taken within the top-k set: its mass is the normaliser
            if in_scratch != 0:
                total = _mass_from(scratch_row, num_scratch, 1.0, threshold, row_max, BLOCK=BLOCK)
            else:
                total = _mass_from(row_ptr, vocab, divisor, threshold, row_max, BLOCK=BLOCK)
        if top_p < 1.0:
            lo, count_lo, in_scratch, num_scratch = _settle(
                row_ptr, vocab, divisor, scratch_row, lo, hi, count_lo, in_scratch, num_scratch, row_max,
                top_p * total, SCRATCH=SCRATCH, USE_MASS=True, BLOCK=BLOCK, PROBES=PROBES)
            threshold = _key_value(lo)
    tl.store(threshold_ptr + row, threshold)
    tl.store(best_ptr + row, -(2 ** 63))  # the draw kernel's running best, reset for this step


@triton.jit
def _uniform(seed, start, BLOCK: tl.constexpr):
    """u in [0, 1) for tokens start .. start+BLOCK-1 (start a multiple of 4): one Philox call
    gives four numbers, so each call serves four neighbouring tokens."""
    r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + tl.arange(0, BLOCK // 4))
    r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK,))
    return tl.uint_to_uniform_float(r)


@triton.jit
def _draw_kernel(logits_ptr, stride_row, params_ptr, threshold_ptr, best_ptr, vocab,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Gumbel-max over the kept tokens of one chunk of a row (greedy rows: the plain max);
    the chunks of a row meet in one atomic max of (order key of the value, -index)."""
    row = tl.program_id(0).to(tl.int64)
    chunk_start = tl.program_id(1) * CHUNK
    row_ptr = logits_ptr + row * stride_row
    seed = tl.load(params_ptr + row * 4)
    temperature = tl.load(params_ptr + row * 4 + 2).to(tl.int32).to(tl.float32, bitcast=True)
    divisor = tl.where(temperature == 0.0, 1.0, temperature)
    threshold = tl.load(threshold_ptr + row)
    best = tl.full((), -float("inf"), tl.float32)
    best_index = tl.zeros((), dtype=tl.int64)
    for start in range(chunk_start, chunk_start + CHUNK, BLOCK):
        x, cols, mask = _scaled_block(row_ptr, start, vocab, divisor, BLOCK)
        if temperature != 0.0:
            u = tl.maximum(_uniform(seed, start, BLOCK), 1.1754943508222875e-38)
            x = tl.where(x >= threshold, x - tl.log(-tl.log(u)), -float("inf"))
        block_best = tl.max(x, axis=0)
        block_index = tl.argmax(x, axis=0).to(tl.int64) + start
        take = block_best > best  # strict: the first of equal maxima wins
        best_index = tl.where(take, block_index, best_index)
        best = tl.where(take, block_best, best)
    # Larger value first, then smaller index (as torch.argmax); past-the-end chunks lose.
    packed = (_order_key(best) << 32) | (0xFFFFFFFF - best_index)
    tl.atomic_max(best_ptr + row, packed, sem="relaxed")


@triton.jit
def _uniform_kernel(seeds_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * vocab + cols, _uniform(seed, start, BLOCK), mask=cols < vocab)


def pack_params(seeds, top_ks, temperatures, top_ps) -> torch.Tensor:
    """Per-row options (sequences or arrays) as the kernel's [B, 4] int64 host tensor (one
    copy to the device): seed, top_k, and the fp32 bits of temperature and top_p."""
    params = np.empty((len(seeds), 4), dtype=np.int64)
    params[:, 0] = seeds
    params[:, 1] = top_ks
    params[:, 2] = np.asarray(temperatures, dtype=np.float32).view(np.int32)
    params[:, 3] = np.asarray(top_ps, dtype=np.float32).view(np.int32)
    return torch.from_numpy(params)


def sample(logits: torch.Tensor, params: torch.Tensor, scratch: torch.Tensor | None = None,
           block: int = 1024, probes: int = 8, num_warps: int = 4, chunk: int = 8192,
           return_thresholds: bool = False):
    """logits [B, V] fp32, bf16 or fp16 (unit last stride; read in fp32), params [B, 4]
    int64 on logits' device ->
    token ids [B] int64 (and, with return_thresholds, each row's smallest kept scaled
    logit [B] fp32: -inf when it keeps every token).

    scratch [>= B, N] fp32 (N a power of two, contiguous): where a row's candidate tokens
    are copied when at most N of them (fewer passes over the whole row); a new [B, 4096]
    one when None. chunk: tokens per program of the draw (a multiple of block).
    """
    assert logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16) \
        and logits.stride(-1) == 1, \
        f"logits must be [B, V] fp32/bf16/fp16 with unit last stride, got {tuple(logits.shape)} {logits.dtype}"
    rows, vocab = logits.shape
    assert params.shape == (rows, 4) and params.dtype == torch.int64 and params.is_contiguous(), \
        f"params must be [{rows}, 4] contiguous int64, got {tuple(params.shape)} {params.dtype}"
    assert params.device == logits.device, "params must be on logits' device"
    assert vocab < 2 ** 31, "token indices are Philox offsets (int32)"
    assert block % 4 == 0 and chunk % block == 0, "chunk must be a multiple of block, block of 4"
    block = min(block, max(16, triton.next_power_of_2(vocab)))  # small vocabularies (tests)
    chunk = min(chunk, triton.cdiv(vocab, block) * block)
    if scratch is None:
        scratch = torch.empty(rows, 4096, dtype=torch.float32, device=logits.device)
    assert scratch.dim() == 2 and scratch.shape[0] >= rows and scratch.dtype == torch.float32 \
        and scratch.is_contiguous() and scratch.device == logits.device, "scratch must be [>= B, N] contiguous fp32"
    thresholds = torch.empty(rows, dtype=torch.float32, device=logits.device)
    best = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _threshold_kernel[(rows,)](logits, logits.stride(0), params, scratch, thresholds, best, vocab,
                                   SCRATCH=scratch.shape[1], BLOCK=block, PROBES=probes, num_warps=num_warps)
        _draw_kernel[(rows, triton.cdiv(vocab, chunk))](logits, logits.stride(0), params, thresholds, best, vocab,
                                                        CHUNK=chunk, BLOCK=block, num_warps=num_warps)
    # best = (value key << 32) | (2^32 - 1 - index)
    out = (0xFFFFFFFF - (best & 0xFFFFFFFF)) if rows else best
    return (out, thresholds) if return_thresholds else out


def uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds [R] int64 -> [R, V] fp32: the u the sampling kernel draws for each row's tokens."""
    assert seeds.dim() == 1 and seeds.dtype == torch.int64 and seeds.is_contiguous()
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _uniform_kernel[(seeds.shape[0],)](seeds, out, vocab, BLOCK=1024)
    return out

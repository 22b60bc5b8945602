"""Next-token choice for a whole batch, on the device (the engine reads it back a step later).

Greedy rows take the argmax. Sampling rows are filtered (temperature, top-k, top-p) to
the tokens at or above a per-row threshold and drawn from what is left. A row's randomness
comes from a stream keyed by its request's seed and the index of the token being drawn
(`draw_seeds`), so its output depends only on its seed and its logits, never on which other
rows share the batch, nor on preemption. On CUDA a Triton kernel pair does it all with the
Gumbel-max trick (kernels/triton_sampler.py): argmax(log p + g) with g = -log(-log u) is an
exact draw from p. The PyTorch path here, the reference and the CPU's, inverts the
filtered distribution's CDF at one uniform a row: one exp a token instead of a uniform and
two logs a token.
"""

from __future__ import annotations

import numpy as np
import torch

from relaycli.engine.sequence import SamplingOptions
from relaycli.engine.staging import stage, to_device


def keep_threshold(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   num_candidates: int | None = None) -> torch.Tensor:
    """The smallest kept value of each row of scaled logits [R, V] (-inf: keep all).

    top-k keeps values >= the k-th largest; top-p then keeps the values >= x_j, where x_j is
    the first value of the descending row at which the running probability (within the
    top-k set) reaches top_p. top_p = 1 keeps the whole top-k set, however the sum rounds.
    """
    vocab = scaled.shape[-1]
    if num_candidates is not None and num_candidates < vocab:
        found = _threshold_of_sorted(scaled, torch.topk(scaled, num_candidates, dim=-1, sorted=True)[0],
                                     top_k, top_p)
        if found is not None:
            return found
    return _threshold_of_sorted(scaled, torch.sort(scaled, dim=-1, descending=True)[0], top_k, top_p)


def _threshold_of_sorted(scaled: torch.Tensor, head: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor) -> torch.Tensor | None:
    """keep_threshold from each row's largest values head [R, n] (descending; n = V for the
    whole row); None when a row's answer lies past its head."""
    vocab, n = scaled.shape[-1], head.shape[-1]
    has_k = top_k < vocab
    if n < vocab:  # (a check that reads back: only the CPU passes a partial head)
        assert bool((top_k[has_k] <= n).all()), "the head must hold every finite top_k"
    neg_inf = torch.full_like(head[:, 0], float("-inf"))
    k_value = torch.where(has_k, head.gather(1, (top_k.clamp(max=n) - 1)[:, None])[:, 0], neg_inf)
    row_max = head[:, 0:1]
    # The top-k set's mass over the whole row: ties of the k-th value may lie past the head.
    in_k = scaled >= k_value[:, None]
    total = torch.where(in_k, torch.exp(scaled - row_max), 0.0).sum(-1)
    running = torch.cumsum(torch.where(head >= k_value[:, None], torch.exp(head - row_max), 0.0), dim=-1)
    reached = running >= (top_p * total)[:, None]
    has_p = top_p < 1.0
    first = reached.float().argmax(dim=-1)  # first index that reaches top_p (0 if none)
    found = reached.any(dim=-1)
    if n < vocab and bool((has_p & ~found).any()):
        return None  # the head holds less than top_p of the mass: the answer is further on
    # A whole row that never reaches top_p (its sum rounded below) keeps its top-k set.
    p_value = torch.where(has_p & found, head.gather(1, first[:, None])[:, 0], neg_inf)
    return torch.maximum(k_value, p_value)


# How far below a masked row's smallest allowed logit its forbidden tokens are put, in units
# of its temperature: 64 exceeds the widest spread of two fp32 Gumbel draws (about 21), so
# a forbidden token is never drawn, and its probability (e**-64 at most) moves no threshold.
MASK_GAP = 64.0


def floor_masked(logits: torch.Tensor, rows: list[int], temperatures: list[float]) -> torch.Tensor:
    """logits with the -inf of the given rows replaced by their smallest finite value minus
    MASK_GAP x temperature (1 for greedy rows): the same draws from finite values."""
    dev = logits.device
    index = to_device(rows, torch.int64, dev)
    gap = to_device([MASK_GAP * (t if t > 0 else 1.0) for t in temperatures], torch.float32, dev)
    part = logits.index_select(0, index).float()
    finite = torch.isfinite(part)
    floor = torch.where(finite, part, float("inf")).amin(dim=-1) - gap
    out = logits.clone()
    out[index] = torch.where(finite, part, floor[:, None]).to(logits.dtype)
    return out


CPU_CANDIDATES = 1024  # tokens the CPU looks among for top-k / top-p before sorting a whole row

_MASK64 = (1 << 64) - 1
# splitmix64's constants: the seed's and the draw index's multipliers, then the two mixes
_SEED_MUL, _DRAW_MUL, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def seed_words(seeds: list[int]) -> np.ndarray:
    """Seeds as the uint64 words draw_seeds mixes (any int: past 64 bits and below zero too)."""
    return np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64)


def draw_seeds(words: np.ndarray, draws: list[int]) -> np.ndarray:
    """The random stream of each (seed, draw) pair, seeds given as seed_words: a 63-bit mix
    (splitmix64) of a request's seed and the index of the token it draws, as int64, so every
    token's randomness is fixed by the request alone. One pass of numpy's wrapping uint64
    arithmetic (a decode step of 256 sampled rows would otherwise mix 256 seeds in Python)."""
    s, d = words, np.array(draws, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = s * np.uint64(_SEED_MUL) + (d + np.uint64(1)) * np.uint64(_DRAW_MUL)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        return ((z ^ (z >> np.uint64(31))) >> np.uint64(1)).astype(np.int64)


def draw_uniforms(words: np.ndarray, draws: list[int]) -> np.ndarray:
    """One uniform in [0, 1) float64 a (seed, draw) pair: the top 53 bits of draw_seeds."""
    return (draw_seeds(words, draws) >> 10).astype(np.float64) * 2.0**-53


CDF_BLOCK = 256  # tokens a block of inverse_cdf's first level


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """An exact draw from each row of probs [R, V] (fp32, >= 0, not all 0; unnormalised):
    the first token whose running mass exceeds u x the row's mass, u [R] float64 in [0, 1).

    Two levels, so rounding loses no token's mass: the running sum of the rows' block sums,
    then that of the chosen block's tokens, both in fp64 over few terms (one fp32 running
    sum over a whole vocabulary would drop tokens smaller than its rounding step). A token
    of mass 0 adds nothing to either sum, so it is never the one; each target is kept
    below its level's total, so there always is one."""
    rows, vocab = probs.shape
    blocks = torch.nn.functional.pad(probs, (0, -vocab % CDF_BLOCK)).view(rows, -1, CDF_BLOCK)
    block_cdf = torch.cumsum(blocks.sum(dim=-1).double(), dim=-1)
    total = block_cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    b = torch.searchsorted(block_cdf, target[:, None], right=True)
    before = torch.nn.functional.pad(block_cdf, (1, 0))[:, :-1].gather(1, b)[:, 0]
    inner = torch.cumsum(blocks[torch.arange(rows, device=probs.device), b[:, 0]].double(), dim=-1)
    inner_total = inner[:, -1]
    rest = torch.minimum(target - before, torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    return b[:, 0] * CDF_BLOCK + torch.searchsorted(inner, rest[:, None], right=True)[:, 0]


class Sampler:
    """Token choice for a batch. kernel "triton": two Triton launches for the whole batch
    (kernels/triton_sampler.py, CUDA); "torch": PyTorch ops on any device, where each
    sampled row inverts its CDF at the uniform of draw_uniforms. Both draw from the same
    filtered distribution; their random streams differ."""

    KERNELS = ("torch", "triton")

    def __init__(self, device: torch.device, kernel: str = "torch") -> None:
        if kernel not in self.KERNELS:
            raise ValueError(f"sampler kernel must be one of {self.KERNELS}, got {kernel!r}")
        self.device, self.kernel = device, kernel
        # the last batch's options (kept alive, so their ids stay theirs) and their packed
        # columns: a decode step's rows change only when rows join or leave
        self._batch_key: tuple | None = None
        self._batch: list[SamplingOptions] = []
        self._seed_words = np.empty(0, dtype=np.uint64)
        self._columns = np.empty((0, 4), dtype=np.int64)

    def packed_params(self, options: list[SamplingOptions], draws: list[int], vocab: int) -> torch.Tensor:
        """The Triton kernels' [B, 4] int64 host params (triton_sampler.pack_params) of this
        step: each row's seed mixed with its draw, its top-k, temperature and top-p. The
        other columns are packed again only when the batch's options are other objects."""
        from relaycli.kernels import triton_sampler
        key = (vocab, *map(id, options))
        if key != self._batch_key:
            self._batch_key, self._batch = key, list(options)
            self._seed_words = seed_words([o.seed for o in options])
            self._columns = triton_sampler.pack_params(
                np.zeros(len(options), dtype=np.int64), [min(o.top_k or vocab, vocab) for o in options],
                [o.temperature for o in options], [o.top_p for o in options]).numpy()
        params = self._columns.copy()
        params[:, 0] = draw_seeds(self._seed_words, draws)
        return torch.from_numpy(params)

    def sample(self, logits: torch.Tensor, options: list[SamplingOptions], draws: list[int]) -> list[int]:
        """logits [B, V] (fp32, bf16 or fp16) -> one token id per row (waits for the device)."""
        return self.sample_tensor(logits, options, draws).tolist()

    def sample_tensor(self, logits: torch.Tensor, options: list[SamplingOptions], draws: list[int],
                      masked: list[int] = ()) -> torch.Tensor:
        """logits [B, V] (fp32, bf16 or fp16) -> token ids [B] int64 on logits' device,
        without waiting for it. Rows are read in fp32 (widening is exact), so narrower
        logits give the tokens their fp32 copy would.

        draws[i]: how many tokens row i's request has drawn before this one (its output index).
        masked: rows whose forbidden tokens are -inf (a constraint's mask).
        """
        if all(opt.is_greedy for opt in options):
            return logits.argmax(dim=-1)  # the same index in any float dtype
        if self.kernel == "triton":
            from relaycli.kernels import triton_sampler
            vocab = logits.shape[-1]
            if masked:  # the kernels' threshold search takes finite values only
                logits = floor_masked(logits, masked, [options[b].temperature for b in masked])
            return triton_sampler.sample(logits, stage(self.packed_params(options, draws, vocab), logits.device))
        return self._sample_torch(logits, options, draws)

    def _sample_torch(self, logits: torch.Tensor, options: list[SamplingOptions], draws: list[int]) -> torch.Tensor:
        logits = logits.float()  # temperature and filters in fp32, as the Triton path computes them
        rows = [i for i, opt in enumerate(options) if not opt.is_greedy]
        # (an argmax of a [B, V] batch costs about what the draw does on a CPU: greedy rows only)
        choice = logits.argmax(dim=-1) if len(rows) < len(options) else logits.new_empty(len(options), dtype=torch.int64)
        vocab = logits.shape[-1]
        dev = logits.device
        picked = [options[i] for i in rows]
        temperature = to_device([o.temperature for o in picked], logits.dtype, dev)
        index = to_device(rows, torch.int64, dev)  # a list index would copy and wait
        # Rows with a top-k or top-p are filtered together; temperature-only rows need no sort.
        cut = [j for j, o in enumerate(picked) if (o.top_k or vocab) < vocab or o.top_p < 1.0]
        # Unnormalised probabilities (inverse_cdf normalises them); filtered tokens get 0.
        scaled = logits[index] / temperature[:, None]
        probs = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
        if cut:
            ks = [min(picked[j].top_k or vocab, vocab) for j in cut]
            # On the CPU a partial sort of the largest tokens is much cheaper than sorting
            # the vocabulary; its coverage check reads a value back, which on a GPU would
            # stall the overlapped step, so the GPU sorts in full.
            candidates = max([CPU_CANDIDATES] + [k for k in ks if k < vocab])
            at = to_device(cut, torch.int64, dev)
            part = scaled[at]
            threshold = keep_threshold(part, to_device(ks, torch.int64, dev),
                                       to_device([picked[j].top_p for j in cut], logits.dtype, dev),
                                       candidates if dev.type == "cpu" and 2 * candidates <= vocab else None)
            probs[at] = probs[at].masked_fill_(part < threshold[:, None], 0.0)
        u = torch.from_numpy(draw_uniforms(seed_words([o.seed for o in picked]), [draws[i] for i in rows]))
        choice[index] = inverse_cdf(probs, u.to(dev))
        return choice

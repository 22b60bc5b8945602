"""The Triton sampling kernel against the PyTorch sampler's threshold and Gumbel-max draw.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (small vocabularies). Inputs are
fresh random draws on every run; logits rounded to bf16 make ties common.
"""

import importlib
import math
import os
import random
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if "relaycli.kernels.triton_sampler" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
    importlib.reload(sys.modules["relaycli.kernels.triton_sampler"])  # @triton.jit chose compiler at import

from relaycli.kernels import triton_sampler  # noqa: E402
from relaycli.engine.sampler import Sampler, keep_threshold  # noqa: E402
from tests.test_sampler import draw_seed  # noqa: E402
from relaycli.engine.sequence import SamplingOptions  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _random_rows(rng: random.Random, vocab: int) -> tuple[torch.Tensor, list, list, list, list]:
    """One row for each pair of logits kind (peaked like a language model, flat, bf16-rounded
    with many ties) and option kind (greedy, temperature only, small top-k, large top-k,
    top-p, top-k and top-p), twice over, with random values."""
    kinds = ["peaked", "flat", "ties"]
    options = ["greedy", "temperature", "small k", "large k", "p", "k and p"]
    cases = [(kind, opt) for kind in kinds for opt in options] * 2
    rows = len(cases)
    logits = torch.randn(rows, vocab) * rng.choice([1.0, 3.0])
    temps, ks, ps = [], [], []
    for r, (kind, opt) in enumerate(cases):
        if kind == "peaked":
            logits[r, torch.randperm(vocab)[:rng.randint(1, 30)]] += rng.uniform(4, 12)
        elif kind == "flat":
            logits[r] *= 0.01
        else:
            logits[r] = (logits[r] * 2).round() / 2  # few distinct values: many ties
        temps.append(0.0 if opt == "greedy" else rng.choice([0.3, 0.7, 1.0, 1.5]))
        small, large = rng.choice([1, 2, 5]), rng.choice([40, vocab // 2, vocab - 1])
        ks.append({"small k": small, "large k": large, "k and p": rng.choice([small, large])}.get(opt, vocab))
        ps.append(rng.choice([0.1, 0.5, 0.9, 0.999]) if opt in ("p", "k and p") else 1.0)
    logits = logits.to(torch.bfloat16).float()
    for r in range(rows):
        if ps[r] < 1.0:
            ps[r] = _clear_top_p(logits[r] / (temps[r] or 1.0), ks[r], ps[r], rng)
    seeds = [rng.randrange(2 ** 63) for _ in range(rows)]
    return logits.to(DEVICE), temps, ks, ps, seeds


def _clear_top_p(scaled: torch.Tensor, k: int, p: float, rng: random.Random) -> float:
    """p, or a new draw if p lies within 1e-5 of a running probability of the row.

    There, which token first reaches p depends on the order of an fp32 sum (the kernel's
    blocked sums and the reference's cumsum then differ by a token; both are right), so
    an exact comparison would fail now and then. Measured on 1,920 peaked rows at
    p = 0.9/0.999: 10 such disagreements, each with the float64 running sum within
    1.5e-7 of p. On a flat row of a large vocabulary every running value lies within
    1e-5 of the next, so the margin shrinks to a quarter of the widest step there."""
    values = torch.sort(scaled.double(), descending=True)[0]
    top = values[values >= values[min(k, values.numel()) - 1]]
    running = torch.cumsum(torch.exp(top - top[0]), 0)
    running = running / running[-1]
    steps = torch.diff(running, prepend=running.new_zeros(1))
    margin = min(1e-5, 0.25 * float(steps.max()))
    while bool(((running - p).abs() < margin).any()):
        p = rng.uniform(0.05, 0.999)
    return p


def _expected(logits, temps, ks, ps, seeds):
    """(token, kept mask) per row from the PyTorch threshold and the kernel's own uniforms."""
    vocab = logits.shape[-1]
    greedy = torch.tensor(temps, device=logits.device) == 0
    t = torch.tensor([x or 1.0 for x in temps], device=logits.device)
    scaled = logits / t[:, None]
    threshold = keep_threshold(scaled, torch.tensor(ks, device=logits.device), torch.tensor(ps, device=logits.device))
    threshold = torch.where(greedy, float("-inf"), threshold)
    kept = scaled >= threshold[:, None]
    u = triton_sampler.uniforms(torch.tensor(seeds, device=logits.device), vocab)
    gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))
    noisy = torch.where(kept, scaled + gumbel, float("-inf"))
    token = torch.where(greedy, logits.argmax(-1), noisy.argmax(-1))
    return token, kept


@pytest.mark.parametrize("vocab,scratch_width,block,chunk", [(37, 16, 16, 16), (1000, 64, 64, 128), (1000, 1024, 1024, 8192)]
                         + ([(128256, 4096, 1024, 8192), (128256, 64, 1024, 2048)] if CUDA else []))
def test_kernel_keeps_the_reference_tokens_and_draws_the_reference_token(vocab, scratch_width, block, chunk):
    """Rows whose candidates fit the scratch and rows that search their whole row; rows
    drawn by one program and by several (whose results meet in an atomic max)."""
    rng = random.Random()
    logits, temps, ks, ps, seeds = _random_rows(rng, vocab)
    rows = logits.shape[0]
    assert temps[0] == 0.0  # a greedy row whose max sits in several chunks: the first one wins
    logits[0, [vocab - 1, vocab // 2, 3]] = logits[0].max() + 1
    params = triton_sampler.pack_params(seeds, ks, temps, ps).to(DEVICE)
    scratch = torch.empty(rows, scratch_width, device=DEVICE)
    token, thresholds = triton_sampler.sample(logits, params, scratch=scratch, block=block, chunk=chunk,
                                              return_thresholds=True)
    want_token, want_kept = _expected(logits, temps, ks, ps, seeds)
    t = torch.tensor([x or 1.0 for x in temps], device=DEVICE)
    got_kept = logits / t[:, None] >= thresholds[:, None]
    for r in range(rows):
        assert torch.equal(got_kept[r], want_kept[r]), (r, temps[r], ks[r], ps[r])
    assert torch.equal(token, want_token)
    assert bool(want_kept.gather(1, token[:, None]).all())  # every draw is a kept token


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_narrow_logits_as_their_fp32_copy(dtype):
    """The engine hands the sampler logits in the model's dtype: the kernel widens them
    on load, so every row (greedy, filtered, temperature-only) keeps and draws what the
    fp32 copy of the same values keeps and draws."""
    rng = random.Random()
    logits, temps, ks, ps, seeds = _random_rows(rng, 1000)
    narrow = logits.to(dtype)
    params = triton_sampler.pack_params(seeds, ks, temps, ps).to(DEVICE)
    got, got_t = triton_sampler.sample(narrow, params, return_thresholds=True)
    want, want_t = triton_sampler.sample(narrow.float(), params, return_thresholds=True)
    assert torch.equal(got, want) and torch.equal(got_t, want_t)
    if dtype != torch.bfloat16 and not CUDA:
        return  # the engine's own dtype goes on through Sampler (the interpreter is slow)
    sampler = Sampler(torch.device(DEVICE), "triton")
    opts = [SamplingOptions(max_tokens=1, temperature=t, top_k=k if k < 1000 else None, top_p=p, seed=7)
            for t, k, p in zip(temps, ks, ps)]
    draws = list(range(len(opts)))
    assert sampler.sample(narrow, opts, draws) == sampler.sample(narrow.float(), opts, draws)
    greedy = [SamplingOptions(max_tokens=1)] * len(opts)
    assert sampler.sample(narrow, greedy, draws) == narrow.float().argmax(-1).tolist()


def test_kernel_draws_follow_the_filtered_distribution():
    """Many rows, one seed each, on the same logits: frequencies match the kept softmax.
    (The interpreter runs a filtering row slowly, so on the CPU only the temperature-only
    case runs; the exact test above already ties filtered draws to the reference.)"""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2])
    cases = [(1.3, 8, 1.0)] + ([(0.8, 5, 0.9), (1.0, 3, 1.0)] if CUDA else [])
    n = 20000 if CUDA else 2000
    for temp, k, p in cases:
        scaled = logits / temp
        keep = scaled >= keep_threshold(scaled[None], torch.tensor([k]), torch.tensor([p]))[0]
        want = torch.softmax(scaled.masked_fill(~keep, float("-inf")), 0)
        first = random.randrange(10 ** 9)
        seeds = [draw_seed(first, d) for d in range(n)]
        params = triton_sampler.pack_params(seeds, [k] * n, [temp] * n, [p] * n).to(DEVICE)
        tokens = triton_sampler.sample(logits[None].expand(n, -1).contiguous().to(DEVICE), params).cpu()
        counts = torch.bincount(tokens, minlength=8).double() / n
        for i in range(8):
            se = math.sqrt(float(want[i]) * (1 - float(want[i])) / n)
            assert abs(float(counts[i]) - float(want[i])) < 5 * se + 2e-3, (temp, k, p, i, float(counts[i]), float(want[i]))


def test_triton_sampler_rows_are_independent_of_the_batch():
    """Sampler(kernel="triton"): a row's token depends on its logits, options and draw
    index alone; greedy rows are the argmax."""
    rng = random.Random()
    vocab = 500
    logits = torch.randn(5, vocab, device=DEVICE)
    opts = [SamplingOptions(max_tokens=1, temperature=1.0, seed=rng.randrange(10 ** 6)), SamplingOptions(max_tokens=1),
            SamplingOptions(max_tokens=1, temperature=0.7, top_p=0.8, seed=12),
            SamplingOptions(max_tokens=1, temperature=1.2, top_k=4, seed=13), SamplingOptions(max_tokens=1)]
    draws = [0, 5, 2, 9, 1]
    sampler = Sampler(torch.device(DEVICE), "triton")
    together = sampler.sample(logits, opts, draws)
    alone = [sampler.sample(logits[i:i + 1], [opts[i]], [draws[i]])[0] for i in range(5)]
    assert together == alone
    assert together[1] == int(logits[1].argmax()) and together[4] == int(logits[4].argmax())
    later = [sampler.sample(logits[:1], [opts[0]], [d])[0] for d in range(30)]
    assert len(set(later)) > 1  # another draw index, another stream


def test_constrained_rows_draw_only_allowed_tokens():
    """A constraint's mask reaches the Triton sampler as a finite floor (floor_masked): every
    row, greedy or filtered, draws an allowed token."""
    gen = torch.Generator().manual_seed(5)
    vocab, rows = 512, 8
    logits = torch.randn(rows, vocab, generator=gen) * 3
    allowed = torch.rand(rows, vocab, generator=gen) < 0.05
    allowed[:, 11] = True
    masked = logits.masked_fill(~allowed, float("-inf")).to(DEVICE)
    opts = [SamplingOptions(max_tokens=4, temperature=t, top_k=k, top_p=p, seed=s)
            for s, (t, k, p) in enumerate([(0.0, None, 1.0), (1.0, None, 1.0), (0.7, 5, 1.0), (1.3, 400, 0.9),
                                           (2.0, None, 0.5), (9.0, 300, 0.99), (1.0, 2, 0.3), (0.5, None, 0.95)])]
    sampler = Sampler(torch.device(DEVICE), "triton")
    for draw in range(3):
        tokens = sampler.sample_tensor(masked, opts, [draw] * rows, list(range(rows))).tolist()
        assert all(allowed[i, t] for i, t in enumerate(tokens)), tokens

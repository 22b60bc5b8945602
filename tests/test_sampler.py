"""The batched sampler draws from exactly the filtered distribution, row by row."""

import math
import random

import torch

from relaycli.engine.sampler import Sampler, draw_seeds, inverse_cdf, keep_threshold, seed_words
from relaycli.engine.sequence import SamplingOptions


def draw_seed(seed: int, draw: int) -> int:
    """splitmix64 of a seed and a draw index in Python integers: the stream draw_seeds must give."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (draw + 1) * 0xD1B54A32D192ED03) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


def filter_logits(logits, temperature, top_k, top_p, num_candidates=None):
    """Log-probabilities after temperature, top-k and top-p (dropped tokens -inf): the
    sampler's filter, a token kept where its scaled logit reaches keep_threshold."""
    scaled = logits / temperature[:, None]
    threshold = keep_threshold(scaled, top_k, top_p, num_candidates)
    return torch.log_softmax(scaled.masked_fill(scaled < threshold[:, None], float("-inf")), dim=-1)


def _reference_probs(logits, temperature, top_k, top_p):
    """Straightforward per-row filtering: the distribution the sampler must draw from."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])[:top_k]
    probs = torch.softmax(torch.tensor([scaled[i] for i in order]), 0).tolist()
    kept, mass = [], 0.0
    for i, p in zip(order, probs):
        if top_p < 1.0 and mass >= top_p:  # top_p = 1 filters nothing, however the sum rounds
            break
        kept.append(i)
        mass += p
    z = sum(math.exp(scaled[i]) for i in kept)
    return {i: math.exp(scaled[i]) / z for i in kept}


def test_filter_matches_per_row_reference():
    rng = random.Random()
    logits = torch.randn(6, 50) * 3
    temps = [rng.uniform(0.3, 2.0) for _ in range(6)]
    ks = [rng.choice([1, 3, 10, 50]) for _ in range(6)]
    ps = [rng.choice([0.2, 0.6, 0.95, 1.0]) for _ in range(6)]
    log_p = filter_logits(logits, torch.tensor(temps), torch.tensor(ks), torch.tensor(ps))
    for r in range(6):
        want = _reference_probs(logits[r].tolist(), temps[r], ks[r], ps[r])
        got = {i: math.exp(v) for i, v in enumerate(log_p[r].tolist()) if v > float("-inf")}
        assert set(got) == set(want)
        assert all(abs(got[i] - want[i]) < 1e-5 for i in want)


def test_top_p_one_keeps_every_token_even_when_the_running_sum_rounds_to_one():
    # One token holds nearly all the mass: in fp32 the running sum reaches 1.0 after it,
    # and a ">= top_p" test would drop the 49 others although top_p = 1 filters nothing.
    logits = torch.cat([torch.tensor([[30.0]]), torch.randn(1, 49)], dim=1)
    log_p = filter_logits(logits, torch.tensor([1.0]), torch.tensor([50]), torch.tensor([1.0]))
    assert torch.isfinite(log_p).all()
    torch.testing.assert_close(log_p, torch.log_softmax(logits, dim=-1))


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2])
    opt = SamplingOptions(max_tokens=1, temperature=0.8, top_k=5, top_p=0.9, seed=random.randrange(10**6))
    want = _reference_probs(logits.tolist(), 0.8, 5, 0.9)
    sampler = Sampler(torch.device("cpu"))
    n = 20000
    counts = {}
    # One request drawing its tokens 0..n-1: an exact categorical sampler gives
    # frequencies within a few standard errors of want.
    for draw in range(n):
        tok = sampler.sample(logits[None], [opt], [draw])[0]
        counts[tok] = counts.get(tok, 0) + 1
    assert set(counts) <= set(want)
    for i, p in want.items():
        se = math.sqrt(p * (1 - p) / n)
        assert abs(counts.get(i, 0) / n - p) < 5 * se + 1e-3, (i, counts.get(i, 0) / n, p)


def test_temperature_only_draws_follow_the_softmax():
    """No top-k/top-p: the sampler skips the sort; the draw is still exact."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    opt = SamplingOptions(max_tokens=1, temperature=1.3, seed=random.randrange(10**6))
    want = torch.softmax(logits / 1.3, 0).tolist()
    sampler = Sampler(torch.device("cpu"))
    n = 20000
    counts = [0] * 5
    for draw in range(n):
        counts[sampler.sample(logits[None], [opt], [draw])[0]] += 1
    for i, p in enumerate(want):
        assert abs(counts[i] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3, (i, counts[i] / n, p)


def test_batch_rows_are_independent_and_greedy_rows_argmax():
    torch.manual_seed(random.randrange(10**6))
    logits = torch.randn(5, 300)
    opts = [SamplingOptions(max_tokens=1, temperature=1.0, seed=11), SamplingOptions(max_tokens=1),
            SamplingOptions(max_tokens=1, temperature=0.7, top_p=0.8, seed=12),
            SamplingOptions(max_tokens=1, temperature=1.2, top_k=4, seed=13), SamplingOptions(max_tokens=1)]
    draws = [0, 3, 7, 1, 2]
    together = Sampler(torch.device("cpu")).sample(logits, opts, draws)
    alone = [Sampler(torch.device("cpu")).sample(logits[i:i + 1], [opts[i]], [draws[i]])[0] for i in range(5)]
    assert together == alone
    again = Sampler(torch.device("cpu")).sample(logits, opts, draws)  # no state: the same draws repeat
    assert again == together
    assert together[1] == int(logits[1].argmax()) and together[4] == int(logits[4].argmax())


def test_narrow_logits_sample_as_their_fp32_copy():
    """Logits in bf16 (the model's dtype on a GPU) give every row the token their fp32
    copy gives: the sampler widens them before temperature and filters."""
    torch.manual_seed(random.randrange(10**6))
    logits = (torch.randn(6, 400) * 3).to(torch.bfloat16)
    opts = [SamplingOptions(max_tokens=1, temperature=0.8, seed=3), SamplingOptions(max_tokens=1),
            SamplingOptions(max_tokens=1, temperature=1.1, top_p=0.7, seed=4),
            SamplingOptions(max_tokens=1, temperature=0.5, top_k=5, seed=5),
            SamplingOptions(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, seed=6), SamplingOptions(max_tokens=1)]
    # and rows whose top-p set a bf16 running sum would get wrong (flat rows, p = 0.5)
    flat = (torch.randn(256, 400) * 0.5).to(torch.bfloat16)
    logits = torch.cat([logits, flat])
    opts += [SamplingOptions(max_tokens=1, temperature=1.0, top_p=0.5, seed=random.randrange(10**6))
             for _ in range(256)]
    draws = [4, 0, 2, 8, 1, 3] + list(range(256))
    sampler = Sampler(torch.device("cpu"))
    assert sampler.sample(logits, opts, draws) == sampler.sample(logits.float(), opts, draws)


def _peaked_logits(rows: int, vocab: int, head: int = 20) -> torch.Tensor:
    """A few likely tokens and a long tail, as a language model gives: the top-p set is small."""
    logits = torch.randn(rows, vocab)
    for r in range(rows):
        logits[r, torch.randperm(vocab)[:head]] += 12.0
    return logits


def test_candidate_filter_equals_the_full_sort():
    """The CPU's partial sort finds exactly the threshold the full sort finds."""
    from relaycli.engine.sampler import _threshold_of_sorted
    rng = random.Random()
    vocab, rows = 3000, 8
    logits = _peaked_logits(rows, vocab)
    temps = torch.tensor([rng.uniform(0.5, 1.0) for _ in range(rows)])
    # every row filters: a finite top_k, or top_p < 1, or both
    ks = torch.tensor([rng.choice([1, 7, 50, vocab]) for _ in range(rows)])
    ps = torch.tensor([rng.choice([0.3, 0.8, 0.95]) if k == vocab else rng.choice([0.5, 1.0]) for k in ks.tolist()])
    scaled = logits / temps[:, None]
    part = _threshold_of_sorted(scaled, torch.topk(scaled, 64, dim=-1)[0], ks, ps)
    assert part is not None  # the peaked rows hold their top_p mass among 64 candidates
    assert torch.equal(part, keep_threshold(scaled, ks, ps))
    full = filter_logits(logits, temps, ks, ps)
    assert torch.equal(filter_logits(logits, temps, ks, ps, num_candidates=64), full)
    kept = torch.isfinite(full)
    for r in range(rows):  # and both are the per-row reference
        want = _reference_probs(logits[r].tolist(), float(temps[r]), int(ks[r]), float(ps[r]))
        assert set(torch.nonzero(kept[r]).flatten().tolist()) == set(want)


def test_candidate_filter_falls_back_when_the_tail_matters():
    """A flat row spreads its top_p mass past the candidates: the full sort runs, same answer."""
    from relaycli.engine.sampler import _threshold_of_sorted
    vocab = 2000
    logits = torch.randn(2, vocab) * 0.01
    temps, ks, ps = torch.ones(2), torch.tensor([vocab, 5]), torch.tensor([0.9, 1.0])
    assert _threshold_of_sorted(logits, torch.topk(logits, 64, dim=-1)[0], ks, ps) is None
    got = filter_logits(logits, temps, ks, ps, num_candidates=64)
    assert int(torch.isfinite(got[0]).sum()) > 64 and int(torch.isfinite(got[1]).sum()) == 5
    assert torch.equal(got, filter_logits(logits, temps, ks, ps))


def test_tokens_tied_with_the_last_kept_one_are_kept():
    """top-k and top-p keep every token equal to the last one they keep (a sort would pick
    among equals arbitrarily); logits rounded to bf16 tie often."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 2.0, 0.0]] * 2)
    got = filter_logits(logits, torch.ones(2), torch.tensor([2, 6]), torch.tensor([1.0, 0.75]))
    kept = torch.isfinite(got)
    # top_k = 2: the 2nd largest value is 2.0, held by three tokens
    assert kept[0].tolist() == [True, True, True, False, True, False]
    # top_p = 0.75: 3.0 alone holds 0.44 of the mass, so the head reaches 2.0, and all of its ties
    assert kept[1].tolist() == [True, True, True, False, True, False]
    torch.testing.assert_close(got[0].exp().sum(), torch.tensor(1.0))


def test_draw_seeds_separate_requests_and_draws():
    pairs = [(s, d) for s in range(50) for d in range(50)]
    seeds = set(draw_seeds(seed_words([s for s, _ in pairs]), [d for _, d in pairs]).tolist())
    assert len(seeds) == 2500 and all(0 <= x < 2 ** 63 for x in seeds)
    assert draw_seeds(seed_words([7]), [3]).tolist() == draw_seeds(seed_words([7]), [3]).tolist()


def test_draw_seeds_is_draw_seed_for_every_pair():
    """The vectorised mix is splitmix64 in Python integers, for seeds past 64 bits and below zero too."""
    rng = random.Random(5)
    seeds = [rng.randrange(-2 ** 70, 2 ** 70) for _ in range(300)] + [0, -1, 2 ** 64 - 1, 2 ** 63]
    draws = [rng.randrange(0, 1 << 20) for _ in seeds]
    assert draw_seeds(seed_words(seeds), draws).tolist() == [draw_seed(s, d) for s, d in zip(seeds, draws)]


def test_packed_params_follow_every_steps_draws_and_every_new_batch():
    """The Triton kernels' params, packed again only for a batch of other options, equal a
    fresh packing at every step."""
    import pytest
    triton_sampler = pytest.importorskip("relaycli.kernels.triton_sampler")

    def fresh(opts, draws, vocab):
        return triton_sampler.pack_params(draw_seeds(seed_words([o.seed for o in opts]), draws),
                                          [min(o.top_k or vocab, vocab) for o in opts],
                                          [o.temperature for o in opts], [o.top_p for o in opts])

    sampler = Sampler(torch.device("cpu"), "triton")
    batch = [SamplingOptions(max_tokens=8, temperature=0.5 + i / 10, top_p=0.9, top_k=None if i % 2 else 7,
                             seed=1000 * i - 3) for i in range(5)]
    steps = [(batch, [0] * 5, 100), (batch, [1, 2, 3, 4, 5], 100), (batch, [2, 3, 4, 5, 6], 5),
             (batch[1:] + [SamplingOptions(max_tokens=8, temperature=0.9, seed=77)], [3, 4, 5, 6, 0], 5),
             (batch[:2], [9, 9], 5)]
    for opts, draws, vocab in steps:
        assert torch.equal(sampler.packed_params(opts, draws, vocab), fresh(opts, draws, vocab))


def test_cpu_sampler_filters_a_large_vocabulary_without_sorting_it(monkeypatch):
    """A 49k-token vocabulary on the CPU: top-k/top-p rows go through the partial sort (no
    torch.sort), and each draw is a token of the row's reference kept set."""
    vocab = 49152
    logits = _peaked_logits(4, vocab)
    opts = [SamplingOptions(max_tokens=1, temperature=0.7, top_p=0.9, seed=1),
            SamplingOptions(max_tokens=1, temperature=1.0, top_k=40, seed=2),
            SamplingOptions(max_tokens=1, temperature=0.8, seed=3), SamplingOptions(max_tokens=1)]
    wants = [_reference_probs(logits[r].tolist(), o.temperature, o.top_k or vocab, o.top_p)
             for r, o in enumerate(opts[:2])]

    def no_sort(*args, **kwargs):
        raise AssertionError("the CPU sampler sorted the whole vocabulary")
    monkeypatch.setattr(torch, "sort", no_sort)
    sampler = Sampler(torch.device("cpu"))
    for draw in range(20):
        got = sampler.sample(logits, opts, [draw] * 4)
        assert got[0] in wants[0] and got[1] in wants[1]
        assert got[3] == int(logits[3].argmax())


def test_vanishing_temperatures_pick_the_argmax_not_a_nan_token():
    # logits / 1e-40 overflows fp32 to inf and the softmax to NaN; such a row asks for the
    # argmax to fp32 precision, with or without top-k / top-p.
    torch.manual_seed(random.randrange(10**6))
    logits = torch.randn(4, 300) * 20
    for temperature in (1e-40, 5e-324, 1e-25):
        opts = [SamplingOptions(max_tokens=1, temperature=temperature, seed=3),
                SamplingOptions(max_tokens=1, temperature=temperature, top_k=5, seed=4),
                SamplingOptions(max_tokens=1, temperature=temperature, top_p=0.9, seed=5),
                SamplingOptions(max_tokens=1, temperature=1.0, seed=6)]
        got = Sampler(torch.device("cpu")).sample(logits, opts, [0, 0, 0, 0])
        assert got[:3] == logits[:3].argmax(dim=-1).tolist(), temperature
    assert SamplingOptions(max_tokens=1, temperature=1e-19).temperature == 1e-19  # still sampled


def test_masked_rows_with_a_finite_floor_draw_as_with_minus_infinity():
    """The Triton sampler gets a constraint's forbidden tokens as a finite floor
    (floor_masked); on the torch path both forms must give the same token for every
    filter, and never a forbidden one."""
    from relaycli.engine.sampler import floor_masked
    gen = torch.Generator().manual_seed(3)
    vocab, rows = 3000, 12
    logits = torch.randn(rows, vocab, generator=gen) * 4
    allowed = torch.rand(rows, vocab, generator=gen) < 0.02
    allowed[:, 7] = True
    masked = logits.masked_fill(~allowed, float("-inf"))
    opts = [SamplingOptions(max_tokens=4, temperature=t, top_k=k, top_p=p, seed=s)
            for s, (t, k, p) in enumerate([(0.0, None, 1.0), (1.0, None, 1.0), (0.7, 5, 1.0), (1.3, 2000, 0.9),
                                           (2.0, None, 0.5), (50.0, 400, 0.99)] * 2)]
    floored = floor_masked(masked, list(range(rows)), [o.temperature for o in opts])
    assert torch.isfinite(floored).all() and torch.equal(floored[allowed], masked[allowed])
    sampler = Sampler(torch.device("cpu"))
    for draw in range(20):
        a = sampler.sample(masked, opts, [draw] * rows)
        b = sampler.sample(floored, opts, [draw] * rows)
        assert a == b and all(allowed[i, t] for i, t in enumerate(a))


def test_inverse_cdf_never_draws_a_token_of_no_mass_and_keeps_tiny_ones():
    """u at the edges and masses 1e-30 apart: the draw is always a token of positive mass,
    u = 0 gives the first of them and u just below 1 the last, and a token far below an fp32
    running sum's rounding step still has its share (a one-level fp32 sum would drop it)."""
    vocab = 1000  # not a multiple of the block: the padding has no mass
    probs = torch.zeros(4, vocab)
    probs[:, [3, 400, 999]] = torch.tensor([1.0, 1e-30, 2.0])
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 1.0 / 3.0 + 1e-12, 1.0 / 3.0 - 1e-12], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [3, 999, 999, 3]
    # the tiny token owns the uniforms just past the first token's third of the mass
    big = torch.zeros(1, 70000)
    big[0, 0], big[0, 69999], big[0, 40000] = 1.0, 1.0, 1e-9
    tiny_u = torch.tensor([(1.0 + 0.5e-9) / (2.0 + 1e-9)], dtype=torch.float64)  # mid-way through it
    assert inverse_cdf(big, tiny_u).tolist() == [40000]

"""The batched sampler draws from exactly the filtered distribution, row by row."""

import math
import random

import torch

from relaycli.engine.sampler import Sampler, filter_logits
from relaycli.engine.sequence import SamplingOptions


def _reference_probs(logits, temperature, top_k, top_p):
    """Straightforward per-row filtering: the distribution the sampler must draw from."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])[:top_k]
    probs = torch.softmax(torch.tensor([scaled[i] for i in order]), 0).tolist()
    kept, mass = [], 0.0
    for i, p in zip(order, probs):
        if mass >= top_p:
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
    # One sequence drawing n times from its own generator: an exact categorical sampler
    # gives frequencies within a few standard errors of want.
    for _ in range(n):
        tok = sampler.sample(logits[None], [7], [opt])[0]
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
    for _ in range(n):
        counts[sampler.sample(logits[None], [3], [opt])[0]] += 1
    for i, p in enumerate(want):
        assert abs(counts[i] / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3, (i, counts[i] / n, p)


def test_batch_rows_are_independent_and_greedy_rows_argmax():
    torch.manual_seed(random.randrange(10**6))
    logits = torch.randn(5, 300)
    opts = [SamplingOptions(max_tokens=1, temperature=1.0, seed=11), SamplingOptions(max_tokens=1),
            SamplingOptions(max_tokens=1, temperature=0.7, top_p=0.8, seed=12),
            SamplingOptions(max_tokens=1, temperature=1.2, top_k=4, seed=13), SamplingOptions(max_tokens=1)]
    together = Sampler(torch.device("cpu")).sample(logits, [0, 1, 2, 3, 4], opts)
    alone = [Sampler(torch.device("cpu")).sample(logits[i:i + 1], [i], [opts[i]])[0] for i in range(5)]
    assert together == alone
    assert together[1] == int(logits[1].argmax()) and together[4] == int(logits[4].argmax())

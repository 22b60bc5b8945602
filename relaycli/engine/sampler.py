"""Next-token choice for a whole batch, on the device (the engine reads it back a step later).

Greedy rows take the argmax. Sampling rows are filtered (temperature, top-k, top-p) as
one batched tensor operation and drawn by the Gumbel-max trick: argmax(log p + g) with
g = -log(-log u) is an exact draw from p. Each sequence owns a torch.Generator seeded
from its row's seed that supplies its u, so its output depends only on its seed and its
logits, never on which other rows share the batch.
"""

from __future__ import annotations

import torch

from relaycli.engine.sequence import SamplingOptions
from relaycli.engine.staging import to_device


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, num_candidates: int | None = None) -> torch.Tensor:
    """Log-probabilities after temperature, top-k and top-p; dropped tokens get -inf.

    logits [R, V] fp32; temperature [R] (> 0), top_k [R] int64 (V = off), top_p [R] in (0, 1].
    num_candidates: look for the kept tokens among each row's num_candidates largest
    (at least every finite top_k) instead of sorting the whole vocabulary; a row whose
    candidates hold less than its top_p mass sends the batch down the full sort. Same
    result either way; it needs a host check, so only CPU callers pass it.
    """
    scaled = logits / temperature[:, None]
    vocab = scaled.shape[-1]
    if num_candidates is not None and num_candidates < vocab:
        out = _filter_candidates(scaled, top_k, top_p, num_candidates)
        if out is not None:
            return out
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    log_probs_sorted = _keep_log_probs(sorted_logits, torch.softmax, top_k, top_p)
    return torch.empty_like(log_probs_sorted).scatter_(-1, order, log_probs_sorted)


def _keep_log_probs(sorted_logits: torch.Tensor, probs_of, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Renormalised log-probabilities of the kept tokens of rows sorted in descending order."""
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    probs = probs_of(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    # top_p = 1 keeps every token: an fp32 running sum can reach 1 before the last few.
    drop |= ((torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.log_softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)


def _filter_candidates(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       num_candidates: int) -> torch.Tensor | None:
    """filter_logits on each row's num_candidates largest tokens; None when they cannot hold the answer."""
    vocab = scaled.shape[-1]
    assert bool((top_k[top_k < vocab] <= num_candidates).all()), "num_candidates must cover every top_k"
    cand, index = torch.topk(scaled, num_candidates, dim=-1, sorted=True)
    # Probabilities against the whole top-k set: the candidates hold all of it when top_k
    # is finite; otherwise the normaliser is the whole row's.
    whole = torch.logsumexp(scaled, dim=-1)

    def probs_of(masked: torch.Tensor, dim: int) -> torch.Tensor:
        norm = torch.where(top_k < vocab, torch.logsumexp(masked, dim=dim), whole)
        return torch.exp(masked - norm[:, None])

    # Without a top_k, tokens past the candidates are kept when the candidates' mass stays
    # under top_p (or top_p = 1): then the whole row must be sorted.
    mass = torch.exp(cand - whole[:, None]).sum(-1)
    needs_more = (top_k >= vocab) & ((top_p >= 1.0) | (mass < top_p))
    if bool(needs_more.any()):
        return None
    kept = _keep_log_probs(cand, probs_of, top_k, top_p)
    return torch.full_like(scaled, float("-inf")).scatter_(-1, index, kept)


CPU_CANDIDATES = 1024  # tokens the CPU looks among for top-k / top-p before sorting a whole row


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def generator(self, seq_id: int, seed: int) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[seq_id] = gen
        return gen

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, seq_ids: list[int], options: list[SamplingOptions]) -> list[int]:
        """logits [B, V] fp32 -> one token id per row (waits for the device)."""
        return self.sample_tensor(logits, seq_ids, options).tolist()

    def sample_tensor(self, logits: torch.Tensor, seq_ids: list[int], options: list[SamplingOptions]) -> torch.Tensor:
        """logits [B, V] fp32 -> token ids [B] int64 on logits' device, without waiting for it."""
        choice = logits.argmax(dim=-1)
        rows = [i for i, opt in enumerate(options) if not opt.is_greedy]
        if rows:
            vocab = logits.shape[-1]
            dev = logits.device
            picked = [options[i] for i in rows]
            temperature = to_device([o.temperature for o in picked], logits.dtype, dev)
            index = to_device(rows, torch.int64, dev)  # a list index would copy and wait
            # Rows with a top-k or top-p are filtered together; temperature-only rows need no sort.
            cut = [j for j, o in enumerate(picked) if (o.top_k or vocab) < vocab or o.top_p < 1.0]
            every = len(cut) == len(picked)  # then there is no plain softmax to compute at all
            log_p = None if every else torch.log_softmax(logits[index] / temperature[:, None], dim=-1)
            if cut:
                ks = [min(picked[j].top_k or vocab, vocab) for j in cut]
                # On the CPU a partial sort of the largest tokens is much cheaper than sorting
                # the vocabulary; its coverage check reads a value back, which on a GPU would
                # stall the overlapped step, so the GPU sorts in full.
                candidates = max([CPU_CANDIDATES] + [k for k in ks if k < vocab])
                at = None if every else to_device(cut, torch.int64, dev)
                filtered = filter_logits(
                    logits[index if every else index[at]], temperature if every else temperature[at],
                    to_device(ks, torch.int64, dev), to_device([picked[j].top_p for j in cut], logits.dtype, dev),
                    num_candidates=candidates if dev.type == "cpu" and 2 * candidates <= vocab else None)
                if every:
                    log_p = filtered
                else:
                    log_p[at] = filtered
            u = torch.stack([torch.rand(vocab, generator=self.generator(seq_ids[i], options[i].seed), device=dev)
                             for i in rows])
            gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))
            choice[index] = (log_p + gumbel).argmax(dim=-1)
        return choice

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
                  top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities after temperature, top-k and top-p; dropped tokens get -inf.

    logits [R, V] fp32; temperature [R] (> 0), top_k [R] int64 (V = off), top_p [R] in (0, 1].
    """
    scaled = logits / temperature[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = ranks[None, :] >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    # top_p = 1 keeps every token: an fp32 running sum can reach 1 before the last few.
    drop |= ((torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    kept = sorted_logits.masked_fill(drop, float("-inf"))
    log_probs_sorted = torch.log_softmax(kept, dim=-1)
    return torch.empty_like(log_probs_sorted).scatter_(-1, order, log_probs_sorted)


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
            if any((o.top_k or vocab) < vocab or o.top_p < 1.0 for o in picked):
                log_p = filter_logits(
                    logits[index], temperature,
                    to_device([min(o.top_k or vocab, vocab) for o in picked], torch.int64, dev),
                    to_device([o.top_p for o in picked], logits.dtype, dev))
            else:  # temperature only: no sort over the vocabulary
                log_p = torch.log_softmax(logits[index] / temperature[:, None], dim=-1)
            u = torch.stack([torch.rand(vocab, generator=self.generator(seq_ids[i], options[i].seed), device=dev)
                             for i in rows])
            gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))
            choice[index] = (log_p + gumbel).argmax(dim=-1)
        return choice

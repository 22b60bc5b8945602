"""Next-token choice: greedy for the batch at once, seeded sampling per sequence.

Each sampling sequence owns a torch.Generator seeded from its row's seed, so its
output depends only on its seed and logits, never on which other rows share the batch.
"""

from __future__ import annotations

import torch

from relaycli.engine.sequence import SamplingOptions


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """logits [V] fp32 -> probabilities [V] after temperature, top-k and top-p."""
    scaled = logits / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop_sorted = (cum - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


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
        """logits [B, V] fp32 -> one token id per row."""
        greedy = logits.argmax(dim=-1)
        out = greedy.tolist()
        for row, (seq_id, opt) in enumerate(zip(seq_ids, options)):
            if opt.is_greedy:
                continue
            probs = filter_logits(logits[row], opt.temperature, opt.top_k, opt.top_p)
            out[row] = int(torch.multinomial(probs, 1, generator=self.generator(seq_id, opt.seed)))
        return out

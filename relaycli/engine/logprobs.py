"""Log-probabilities of the sampled tokens and their top alternatives, on the device.

What is reported: the model's log-softmax over the vocabulary at temperature 1, after a
row's constraint mask (a token its grammar forbids has -inf, the allowed ones share all
of the probability), before temperature, top-k and top-p. That is OpenAI's choice (the
model's distribution, whatever the sampling settings), made exact under constraints.

Only the rows that ask are computed, in one small launch after the sampler, outside any
CUDA graph: a step whose rows ask for none costs nothing. Every asking row gets the
TOP_N largest (the shape does not depend on what each row asks); the host keeps as many
as the row wants.
"""

from __future__ import annotations

import torch

from relaycli.engine.staging import to_device
from relaycli.engine.vocab import Vocab

TOP_N = 20  # alternatives computed per asking row (OpenAI's most)


class StepLogprobs:
    """One step's logprobs of the rows that asked: row b of the step -> its entry,
    copied to the host without blocking (read with rows() once the step is done)."""

    def __init__(self, rows: list[int], chosen: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor) -> None:
        self.rows = rows
        packed = (chosen, top_ids, top_values)
        if chosen.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in packed]
            for h, t in zip(self._host, packed):
                h.copy_(t, non_blocking=True)
        else:
            self._host = list(packed)

    def rows_list(self) -> dict[int, tuple[float, list[int], list[float]]]:
        """{row of the step: (logprob of its token, top ids, top logprobs)}; the step's
        end must have been waited for (StepHandle.tokens_list)."""
        chosen, ids, values = (t.tolist() for t in self._host)
        return {b: (chosen[i], ids[i], values[i]) for i, b in enumerate(self.rows)}


def step_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wants: list[int | None]) -> StepLogprobs | None:
    """logits [B, V] (after any constraint mask), tokens [B] sampled from them; wants[b]:
    None where row b asks for no logprobs. None when no row asks."""
    rows = [b for b, w in enumerate(wants) if w is not None]
    if not rows:
        return None
    index = to_device(rows, torch.int64, logits.device)
    log_p = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = log_p.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    top_values, top_ids = torch.topk(log_p, min(TOP_N, log_p.shape[-1]), dim=-1)
    return StepLogprobs(rows, chosen, top_ids, top_values)


def entry(vocab: Vocab, token_id: int, logprob: float, top_ids: list[int], top_values: list[float],
          k: int) -> dict:
    """One generated token's entry: its text, logprob, bytes and the k best alternatives
    (tokens a constraint forbids, at -inf, are left out)."""
    def one(tid: int, value: float) -> dict:
        return {"token": vocab.token_text(tid), "logprob": value, "bytes": list(vocab.token_bytes(tid))}
    top = [one(t, v) for t, v in zip(top_ids[:k], top_values[:k]) if v != float("-inf")]
    return {**one(token_id, logprob), "top_logprobs": top}

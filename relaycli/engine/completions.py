"""A row's completions: its sequences, each one's answer, and the row's result. Torch-free.

A row asking for n > 1 completions is n sequences: its own (completion 0, the row's seed)
and n - 1 forks with seeds derive_seed(seed, i), which the scheduler starts from its
prefill (they share its prompt's KV). Its result row is written when the last of them
ends: `text`, `finish_reason` and `logprobs` are those of completion 0,
`completion_tokens` counts the tokens of all n, and `completions` lists each by index.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from relaycli.engine.logprobs import entry
from relaycli.engine.sequence import Sequence
from relaycli.engine.stops import first_stop
from relaycli.engine.vocab import Vocab
from relaycli.io.requests import ResultRow, derive_seed


@dataclass
class Completion:
    index: int
    text: str
    finish_reason: str  # stop | length | error
    completion_tokens: int
    logprobs: list[dict] | None
    error: str | None = None

    def as_dict(self) -> dict:
        return {"index": self.index, "text": self.text, "finish_reason": self.finish_reason,
                "completion_tokens": self.completion_tokens, "logprobs": self.logprobs}


@dataclass
class Group:
    """The completions of one row, by index, as they end."""

    n: int
    done: dict[int, Completion] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.done) == self.n


def row_sequences(seq: Sequence, n: int, new_id: Callable[[], int], matcher: Callable[[], object] | None,
                  logprobs: bool) -> list[Sequence]:
    """seq and its n - 1 forks (held in seq.forks until the scheduler starts them), each with
    its own grammar matcher and logprob list where the row asks."""
    seqs = [seq] + [Sequence(new_id(), seq.own_prompt_ids,
                             replace(seq.sampling, seed=derive_seed(seq.sampling.seed, i)), seq.num_prefix_tokens,
                             seq.prefix_slot, arrival_time=seq.arrival_time, first_position=seq.first_position,
                             fork_of=seq) for i in range(1, n)]
    seq.forks = seqs[1:]
    for one in seqs:
        one.matcher = matcher() if matcher is not None else None
        one.logprob_rows = [] if logprobs else None
    return seqs


def completion_of(seq: Sequence, index: int, stops: tuple[str, ...] | None, eos_ids: frozenset[int],
                  decode, vocab: Vocab | None) -> Completion:
    """seq's answer: its text (without a final end-of-sequence token, cut at a stop
    string), and its logprob entries where it asked (one per generated token kept)."""
    ids = seq.output_ids
    eos_ends = not seq.sampling.ignore_eos or seq.matcher is not None  # (a grammar ends at its EOS)
    if seq.finish_reason == "stop" and eos_ends and ids and ids[-1] in eos_ids:
        ids = ids[:-1]  # the end-of-sequence token is no part of the answer
    text = decode(ids) if decode is not None else ""
    if seq.finish_reason == "stop" and stops:
        cut = first_stop(text, stops)
        text = text if cut is None else text[:cut]
    logprobs = None
    if seq.logprob_rows is not None and vocab is not None:
        k = seq.sampling.logprobs or 0
        logprobs = [entry(vocab, tok, *row, k) for tok, row in zip(ids, seq.logprob_rows)]
    error = None
    if seq.finish_reason == "error":
        error = (f"the answer left its constraint at token {len(ids) - 1}; the constraint may allow no "
                 "end, check it")
    return Completion(index, text, seq.finish_reason, seq.num_completion_tokens, logprobs, error)


def result_row(row_index: int, id: str, url: str | None, seq: Sequence, completions: list[Completion],
               n: int, label: str) -> ResultRow:
    """The row's result from its completions (one, or n by index); seq: any of its sequences;
    label: how an error names the row (TokenRequest.where)."""
    first = completions[0]
    failed = next((c for c in completions if c.error is not None), None)
    if failed is not None:
        return ResultRow.failed(row_index, id, f"{label}: completion {failed.index}: {failed.error}", url)
    return ResultRow(row_index=row_index, id=id, text=first.text, finish_reason=first.finish_reason,
                     prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_prefix_tokens,
                     completion_tokens=sum(c.completion_tokens for c in completions), error=None, url=url,
                     logprobs=first.logprobs, completions=[c.as_dict() for c in completions] if n > 1 else None)

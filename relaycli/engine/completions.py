"""A finished sequence as its row's answer: text, finish reason and logprob entries. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from relaycli.engine.logprobs import entry
from relaycli.engine.sequence import Sequence
from relaycli.engine.stops import first_stop
from relaycli.engine.vocab import Vocab
from relaycli.io.requests import ResultRow


@dataclass
class Completion:
    index: int
    text: str
    finish_reason: str  # stop | length | error
    completion_tokens: int
    logprobs: list[dict] | None
    error: str | None = None


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


def result_row(row_index: int, id: str, url: str | None, seq: Sequence, done: Completion) -> ResultRow:
    if done.error is not None:
        return ResultRow.failed(row_index, id, f"row {row_index}: {done.error}", url)
    return ResultRow(row_index=row_index, id=id, text=done.text, finish_reason=done.finish_reason,
                     prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_prefix_tokens,
                     completion_tokens=done.completion_tokens, error=None, url=url, logprobs=done.logprobs)

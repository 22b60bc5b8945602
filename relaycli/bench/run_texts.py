"""Texts of exact token lengths for `relay bench e2e --through-run`.

The product path starts from text, so the bench needs a system prompt whose compiled
prefix has S tokens and user prompts whose own tokens (everything a row's rendered chat
has after the prefix) are the workload's input lengths. Texts are made of words that
are one token each with a leading space (" the", " house", ...): a byte-level BPE
tokenizer's pre-tokenizer cuts text at spaces before it merges, so n such words are n
tokens. Lengths are then fitted by measuring the real rendering and correcting the word
count, which also covers tokenizers that do not cut at spaces (there the fit is as near
as the words allow, and the report says so).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from relaycli.compile import shared_prefix_ids
from relaycli.prompts import PreparedPrompt, PromptMatcher

_FIT_TRIES = 8  # word-count corrections; exact fits need one or two


class TextFitError(ValueError):
    """A length the tokenizer or template cannot reach; the message names the fix."""


class WordBank:
    """Words that are one token each with a leading space, and (for a text's first word)
    without it. `exact`: a long concatenation of them encodes to one token a word."""

    def __init__(self, tokenizer, min_letters: int = 3, limit: int = 4096) -> None:
        self.tokenizer = tokenizer
        words: list[str] = []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id])
            body = text[1:]
            if (len(body) >= min_letters and text[0] == " " and body.isascii() and body.isalpha()
                    and body.islower() and tokenizer.encode(text) == [token_id]):
                words.append(text)
                if len(words) >= limit:
                    break
        heads = [w for w in words if len(self.tokenizer.encode(w[1:])) == 1]
        if not words or not heads:
            raise TextFitError(f"the tokenizer of this model ({tokenizer.source}) has no lowercase words that are "
                               "single tokens after a space; --through-run needs a byte-level BPE tokenizer")
        self.words, self.heads = words, heads
        probe = random.Random(0)
        sample = [probe.choice(words) for _ in range(512)]
        self.exact = tokenizer.encode("".join(sample)) == [tokenizer.encode(w)[0] for w in sample]

    def sequence(self, rng: random.Random, n: int) -> list[str]:
        """n words; the first one also a single token without its space."""
        return [rng.choice(self.heads)] + [rng.choice(self.words) for _ in range(n - 1)]


def join(words: list[str], n: int) -> str:
    """The first n words as text, without a leading space."""
    return "".join(words[:n])[1:]


@dataclass
class SystemText:
    text: str
    prefix_ids: list[int]


def fit_system_text(tokenizer, bank: WordBank, tokens: int, rng: random.Random) -> SystemText:
    """A system text whose compiled prefix (shared_prefix_ids) has `tokens` tokens, or as
    near as the words reach."""
    words = bank.sequence(rng, max(tokens, 2))
    one = len(shared_prefix_ids(tokenizer, join(words, 1)))
    if tokens < one:
        raise TextFitError(f"--system-tokens {tokens} is shorter than the {one} tokens the chat template of "
                           f"{tokenizer.source} puts around a one-word system prompt; give at least {one}")
    n = tokens - one + 1
    best: SystemText | None = None
    for _ in range(_FIT_TRIES):
        if n > len(words):
            words += bank.sequence(rng, n - len(words) + 1)
        text = join(words, n)
        got = SystemText(text, shared_prefix_ids(tokenizer, text))
        if best is None or abs(len(got.prefix_ids) - tokens) < abs(len(best.prefix_ids) - tokens):
            best = got
        if len(got.prefix_ids) == tokens:
            break
        n = max(1, n + tokens - len(got.prefix_ids))
    return best


@dataclass
class FittedRow:
    text: str
    prepared: PreparedPrompt

    @property
    def own_ids(self) -> list[int]:
        return self.prepared.own_ids


def fit_user_rows(matcher: PromptMatcher, bank: WordBank, input_lens: list[int],
                  rng: random.Random) -> list[FittedRow]:
    """For each input length, a user prompt whose prepared row has that many own tokens
    after the first loaded artifact's prefix (as near as the template allows: a row has
    at least the template's own tokens around one word)."""
    def prepare(text: str) -> PreparedPrompt:
        prepared = matcher.prepare([{"role": "user", "content": text}], None)
        if prepared.prefix_slot is None:
            raise TextFitError("a bench row did not start with the compiled system prompt's tokens; this chat "
                               "template merges text across the prefix boundary, so --through-run cannot use it")
        return prepared

    def own(p: PreparedPrompt) -> int:
        return len(p.own_ids)

    overhead = own(prepare(join(bank.sequence(random.Random(0), 1), 1))) - 1
    rows = []
    for target in input_lens:
        n = max(1, target - overhead)
        words = bank.sequence(rng, n)
        best: FittedRow | None = None
        for _ in range(_FIT_TRIES):
            if n > len(words):
                words += bank.sequence(rng, n - len(words) + 1)
            text = join(words, n)
            got = FittedRow(text, prepare(text))
            if best is None or abs(own(got.prepared) - target) < abs(own(best.prepared) - target):
                best = got
            if own(got.prepared) == target or (n == 1 and own(got.prepared) > target):
                break
            n = max(1, n + target - own(got.prepared))
        rows.append(best)
    return rows

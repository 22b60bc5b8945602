"""A request in flight: torch-free bookkeeping of its tokens and KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Temperatures below this sample as greedy. Dividing fp32 logits by them overflows to inf
# (then NaN), and the distribution they ask for is already one-hot in fp32: two logits
# that differ at all differ by at least ~1e-7 of their size, and exp(-1e-7 / 1e-20)
# rounds to 0. Only exact ties could go another way (greedy takes the first).
GREEDY_BELOW = 1e-20


@dataclass(frozen=True)
class SamplingOptions:
    """What the sampler and the stop rules need (a view of the row's SamplingParams).
    Frozen: the sampler keeps a batch's packed options while the same objects come back."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; else alternatives per token (relaycli/engine/logprobs.py)

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(eq=False)  # identity: the scheduler's list operations must not compare token lists
class Sequence:
    """The rendered prompt is a loaded shared prefix of num_prefix_tokens tokens (prefix_slot),
    whose KV lives outside the paged cache and whose ids the sequence does not hold, then
    the sequence's *own* prompt ids: own token i sits at position position_base + i, which
    is num_prefix_tokens + i unless first_position says otherwise (independent prompt
    modules, whose positions leave gaps)."""

    seq_id: int
    own_prompt_ids: list[int]
    sampling: SamplingOptions
    num_prefix_tokens: int = 0
    prefix_slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached_own: int = 0  # own tokens whose k/v are in the paged cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    arrival_time: float = 0.0  # perf_counter when its request reached the engine
    first_token_time: float | None = None  # perf_counter when its first token was sampled
    first_position: int | None = None  # the position of own token 0; None: num_prefix_tokens
    # Structured answers (all None/empty for a plain row):
    matcher: object | None = None  # its grammar matcher (relaycli/engine/constraints.py)
    logprob_rows: list | None = None  # per output token: (logprob, top ids, top logprobs)
    forks: list[Sequence] = field(default_factory=list)  # completions 1..n-1, forked at its prefill
    fork_of: Sequence | None = None  # a fork before its first step: its prompt KV is this one's
    copy_block: tuple[int, int] | None = None  # (from, to): the fork's copy of its parent's last, partial block

    def __post_init__(self) -> None:
        if (self.prefix_slot is None) != (self.num_prefix_tokens == 0):
            raise ValueError("a sequence has a prefix slot exactly when it has prefix tokens")
        if not self.own_prompt_ids:
            raise ValueError("a sequence needs at least one own prompt token after its prefix")

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_prefix_tokens + len(self.own_prompt_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + len(self.own_prompt_ids) + len(self.output_ids)

    @property
    def position_base(self) -> int:
        return self.num_prefix_tokens if self.first_position is None else self.first_position

    @property
    def position_end(self) -> int:
        """One past the position of the last token: what the model's context bounds."""
        return self.position_base + len(self.own_prompt_ids) + len(self.output_ids)

    @property
    def num_own_tokens(self) -> int:
        return len(self.own_prompt_ids) + len(self.output_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.output_ids)

    def slot(self, i: int, block_size: int) -> int:
        """Flat paged-cache slot of own token i (its block from block_table, then its offset)."""
        return self.block_table[i // block_size] * block_size + i % block_size

    def own_ids(self) -> list[int]:
        return self.own_prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.own_prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

"""What the engine counts while it runs, in memory that does not grow with the job.

A job of a million rows has a million first-token times and thousands of steps. Counts
and sums are kept exactly; the percentiles come from a `Summary`: every value up to a
bound, then a fixed-size uniform sample of all of them. The full per-step logs (each
step's batch, context and time) are kept only when asked for (`keep_logs`, what `relay
bench` reads to price each step against its floor).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

SUMMARY_VALUES = 4096  # values a Summary keeps: exact percentiles up to this many, a sample after

# The engine's own counters (not the rows' tokens, which whoever receives the results
# counts): what `--devices` workers report and their parent sums.
COUNTERS = ("prefix_hits", "prefix_misses", "prompt_fallbacks", "prefill_steps", "decode_steps", "prefill_seconds",
            "decode_seconds", "preemptions", "graphed_decode_steps", "eager_decode_steps", "device_wait_seconds",
            "prefill_tokens", "forks", "module_paths_built", "module_paths_dropped", "prefill_launch_seconds",
            "decode_launch_seconds")


def quantile(ordered: list[float], q: float) -> float | None:
    """The q-quantile of sorted values (the element at index q * n), None when empty.

    relay run's stats and relay bench's rows both use it, so their medians agree."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


class Summary:
    """Count, sum and quantiles of a stream of numbers in bounded memory.

    The first `keep` values are all kept, so quantiles are exact up to there; after that a
    uniform sample of `keep` values stands for all of them (reservoir sampling, with a
    fixed seed so a run's numbers repeat), whose quantiles are within about 1/sqrt(keep) of
    the true rank. The mean is always exact."""

    __slots__ = ("count", "total", "_keep", "_values", "_sorted", "_rng")

    def __init__(self, keep: int = SUMMARY_VALUES) -> None:
        self.count, self.total, self._keep = 0, 0.0, keep
        self._values: list[float] = []
        self._sorted: list[float] | None = None
        self._rng: random.Random | None = None

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if len(self._values) < self._keep:
            self._values.append(value)
        else:
            if self._rng is None:
                self._rng = random.Random(0)
            slot = self._rng.randrange(self.count)
            if slot >= self._keep:
                return
            self._values[slot] = value
        self._sorted = None

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        if self._sorted is None:
            self._sorted = sorted(self._values)
        return quantile(self._sorted, q)

    def kept(self) -> list[float]:
        """The values kept: all of them up to the bound, then the sample."""
        return list(self._values)

    @property
    def exact(self) -> bool:
        """Whether every value is still kept (the quantiles are exact)."""
        return self.count <= self._keep


@dataclass
class EngineStats:
    rows: int = 0
    errors: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    preemptions: int = 0
    graphs_available: bool = False  # decode steps can run as CUDA graphs (CUDA, Triton)
    graphed_decode_steps: int = 0
    eager_decode_steps: int = 0
    eager_reasons: dict[str, int] = field(default_factory=dict)  # why decode steps ran eagerly, counted
    prompt_fallbacks: int = 0  # rows tokenized by full rendering (their prefix could not be spliced)
    device_wait_seconds: float = 0.0  # the engine's thread waiting for the device: the rest is host work
    # The engine's thread in ModelRunner.launch (on the CPU a launch computes the step). On
    # CUDA a prefill is an eager forward, whose every launch the host makes: where this nears
    # prefill_seconds the device waited for the host. A decode step is a graph's replay, or an
    # eager forward: a graph's first step and its capture, or a step no graph fits. A step
    # after constrained rows also reads the one before it back inside its launch (that wait
    # is in device_wait_seconds too).
    prefill_launch_seconds: float = 0.0
    decode_launch_seconds: float = 0.0
    prefill_tokens: int = 0  # own tokens computed by prefill steps (recomputed ones count again)
    forks: int = 0  # completions 2..n of rows with n > 1: their prompt's KV is the row's, not prefilled again
    module_paths_built: int = 0  # prompt-module paths loaded as prefixes (again, after a drop, counted again)
    module_paths_dropped: int = 0  # paths no row in flight used, dropped to make room for another
    keep_logs: bool = field(default=False, repr=False)  # keep the per-row and per-step lists below
    ttft: Summary = field(default_factory=Summary, repr=False)  # time to first token, per row
    decode_step: Summary = field(default_factory=Summary, repr=False)  # seconds, per decode step
    # With keep_logs only (else None): every row's TTFT, every step's (sequences, own context
    # or new tokens, seconds).
    ttft_seconds: list[float] | None = field(default=None, repr=False)
    decode_step_log: list[tuple[int, int, float]] | None = field(default=None, repr=False)
    prefill_step_log: list[tuple[int, int, float]] | None = field(default=None, repr=False)
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None  # set where the job's end comes before its statistics are read

    def __post_init__(self) -> None:
        if self.keep_logs:
            self.ttft_seconds, self.decode_step_log, self.prefill_step_log = [], [], []

    def count_result(self, result) -> None:
        """A finished row (a ResultRow): its tokens, or an error."""
        self.rows += 1
        if result.finish_reason == "error":
            self.errors += 1
        else:
            self.prompt_tokens += result.prompt_tokens
            self.cached_tokens += result.cached_tokens
            self.completion_tokens += result.completion_tokens

    def add_ttft(self, seconds: float) -> None:
        self.ttft.add(seconds)
        if self.ttft_seconds is not None:
            self.ttft_seconds.append(seconds)

    def add_prefill(self, seqs: int, new_tokens: int, seconds: float) -> None:
        self.prefill_steps += 1
        self.prefill_seconds += seconds
        self.prefill_tokens += new_tokens
        if self.prefill_step_log is not None:
            self.prefill_step_log.append((seqs, new_tokens, seconds))

    def add_decode(self, seqs: int, context: int, seconds: float) -> None:
        self.decode_steps += 1
        self.decode_seconds += seconds
        self.decode_step.add(seconds)
        if self.decode_step_log is not None:
            self.decode_step_log.append((seqs, context, seconds))

    def counters(self) -> dict:
        """The engine's counters as plain values; safe to read from another thread."""
        return {**{name: getattr(self, name) for name in COUNTERS}, "eager_reasons": dict(self.eager_reasons)}

    def add_counters(self, counters: dict) -> None:
        """Adds another engine's counters() (or as_dict()) to these."""
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + counters[name])
        for reason, count in counters["eager_reasons"].items():
            self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + count

    def samples(self) -> dict:
        """The TTFT and decode-step values this engine kept (another engine's add_samples)."""
        return {"ttft": self.ttft.kept(), "decode_step": self.decode_step.kept()}

    def add_samples(self, samples: dict) -> None:
        """Another engine's samples() into these quantiles: exact while each engine kept
        every value (SUMMARY_VALUES), a sample of samples after."""
        for value in samples["ttft"]:
            self.ttft.add(value)
        for value in samples["decode_step"]:
            self.decode_step.add(value)

    def decode_step_p50(self) -> float | None:
        return self.decode_step.quantile(0.5)

    def elapsed(self) -> float:
        """Seconds from started to ended, or to now while the job runs."""
        return (time.perf_counter() if self.ended is None else self.ended) - self.started

    def generated_tokens_per_second(self) -> float:
        """Cheap enough to call after every row."""
        elapsed = self.elapsed()
        return self.completion_tokens / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict:
        skip = ("started", "ended", "keep_logs", "ttft", "decode_step", "ttft_seconds", "decode_step_log", "prefill_step_log")
        d = {k: v for k, v in self.__dict__.items() if k not in skip}
        d["ttft_mean_seconds"] = self.ttft.mean()
        d["ttft_p50_seconds"] = self.ttft.quantile(0.5)
        d["ttft_p90_seconds"] = self.ttft.quantile(0.9)
        d["decode_step_mean_seconds"] = self.decode_seconds / self.decode_steps if self.decode_steps else None
        d["decode_step_p50_seconds"] = self.decode_step_p50()
        elapsed = self.elapsed()
        d["elapsed_seconds"] = elapsed
        d["generated_tokens_per_second"] = self.generated_tokens_per_second()
        d["rows_per_second"] = self.rows / elapsed if elapsed > 0 else 0.0
        return d

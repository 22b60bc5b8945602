"""Benchmark workloads: per-request input and output lengths, deterministic from a seed.

`sharegpt` is a synthetic stand-in for ShareGPT conversations (nothing is downloaded):
input and output lengths are log-normal, rounded to whole tokens and clipped,

    input  ~ round(exp(N(ln 128, 1.0^2)))  clipped to [4, 1024]   (median 128)
    output ~ round(exp(N(ln 160, 0.8^2)))  clipped to [4, 1024]   (median 160)

drawn with Python's `random.Random(seed)` (input then output, request by request),
so a seed gives the same lengths on every machine and Python version >= 3.2.
`fixed-IN-OUT` gives every request IN input and OUT output tokens: `fixed-128-256` and
`fixed-256-512` are the classic throughput shapes, and `fixed-32-16` stands for the jobs relay is made
for (a long shared instruction, a short item and a short answer each: classification,
extraction, grading).
The system prompt comes on top of the input: these are each request's *own* tokens.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthDist:
    """A length distribution: fixed (sigma 0) or log-normal around a median, clipped."""

    median: int
    sigma: float = 0.0
    low: int = 1
    high: int = 1 << 20

    def __post_init__(self) -> None:
        if self.median < 1:
            raise ValueError(f"a length median must be at least 1, got {self.median}")
        if self.sigma < 0:
            raise ValueError(f"sigma must be non-negative, got {self.sigma}")
        if not 1 <= self.low <= self.median <= self.high:
            raise ValueError(f"need 1 <= low <= median <= high, got {self.low}, {self.median}, {self.high}")

    def draw(self, rng: random.Random) -> int:
        if self.sigma == 0:
            return self.median
        x = rng.lognormvariate(math.log(self.median), self.sigma)
        return min(self.high, max(self.low, int(round(x))))

    def describe(self) -> str:
        if self.sigma == 0:
            return f"{self.median}"
        return f"log-normal median {self.median}, sigma {self.sigma}, clipped to [{self.low}, {self.high}]"


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    input: LengthDist
    output: LengthDist

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a workload needs a name")

    def describe(self) -> dict:
        return {"name": self.name, "input_tokens": self.input.describe(), "output_tokens": self.output.describe()}


WORKLOADS: dict[str, WorkloadSpec] = {
    "sharegpt": WorkloadSpec("sharegpt", LengthDist(128, 1.0, 4, 1024), LengthDist(160, 0.8, 4, 1024)),
    "fixed-128-256": WorkloadSpec("fixed-128-256", LengthDist(128), LengthDist(256)),
    "fixed-256-512": WorkloadSpec("fixed-256-512", LengthDist(256), LengthDist(512)),
}


@dataclass(frozen=True)
class RequestShape:
    """One benchmark request: its own input tokens and the tokens it must generate."""

    input_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input and output lengths must be positive, got {self.input_len}/{self.output_len}")


FIXED = re.compile(r"fixed-([1-9][0-9]*)-([1-9][0-9]*)")


def get_workload(name: str) -> WorkloadSpec:
    """A named workload, or `fixed-IN-OUT` for any positive IN and OUT."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    fixed = FIXED.fullmatch(name)
    if fixed is None:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}, "
                         "or fixed-IN-OUT (IN input and OUT output tokens a request, e.g. fixed-32-16)")
    return WorkloadSpec(name, LengthDist(int(fixed[1])), LengthDist(int(fixed[2])))


def make_requests(spec: WorkloadSpec, num_requests: int, seed: int,
                  max_output_len: int | None = None) -> list[RequestShape]:
    """num_requests lengths drawn from spec with this seed; max_output_len clips outputs
    further (quick runs), after drawing, so the inputs stay those of the full workload."""
    if num_requests < 1:
        raise ValueError(f"--requests must be at least 1, got {num_requests}")
    if max_output_len is not None and max_output_len < 1:
        raise ValueError(f"--max-output-len must be at least 1, got {max_output_len}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in = spec.input.draw(rng)
        n_out = spec.output.draw(rng)
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        out.append(RequestShape(n_in, n_out))
    return out


def length_summary(requests: list[RequestShape]) -> dict:
    """Mean, median and max of the input and output lengths (for the report)."""
    def stats(xs: list[int]) -> dict:
        s = sorted(xs)
        return {"mean": sum(s) / len(s), "median": s[len(s) // 2], "max": s[-1], "min": s[0]}
    return {"input": stats([r.input_len for r in requests]), "output": stats([r.output_len for r in requests])}

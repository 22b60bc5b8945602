"""End-to-end throughput: relay, --no-relay (same engine) and transformers' `generate`.

Every request is a random token sequence: the shared system prompt (S random ids, its
KV prefilled once and loaded like a compiled artifact), then the request's own input
ids, and it must generate exactly its output length (ignore_eos; transformers gets
min_new_tokens = max_new_tokens). Nothing here prints; `progress` gets one line per run.
"""

from __future__ import annotations

import math

import gc
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from relaycli.models.registry import LoadedModel, load_model
from relaycli.bench.hf_peer import free_memory, hf_row, sync
from relaycli.bench.report import add_speedups, compare_tokens, e2e_line, machine_info, ttft_stats
from relaycli.bench.roofline import ModelShape, decode_context_sum, measure_ceilings, price_decode
from relaycli.bench.workloads import RequestShape, get_workload, length_summary, make_requests
from relaycli.compile import TokenPrefix, prefix_from_ids
from relaycli.config import EngineConfig
from relaycli.engine.engine import Engine, EngineStats, TokenRequest, frozen_heap
from relaycli.engine.sequence import SamplingOptions

SYSTEMS = ("relay", "no-relay", "hf")


@dataclass
class E2EOptions:
    model: str | None = "dummy:tiny"
    workload: str = "sharegpt"
    requests: int = 16
    system_tokens: list[int] = field(default_factory=lambda: [0, 512, 2048])
    max_batch: list[int] = field(default_factory=lambda: [16])
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    dtype: str | None = None
    device: str | None = None
    seed: int = 0
    max_output_len: int | None = None  # clip outputs further (quick runs)
    hf_requests: int | None = None  # transformers answers only the first N (it is slow)
    kv_cache_gb: float | None = None
    # every request samples with these (its seed: its index); temperature 0: greedy
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    # engine runs of each cell, alternating systems; a row is the run of median time
    repeats: int = 1

    def __post_init__(self) -> None:
        get_workload(self.workload)
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {self.repeats}")
        if not 0 <= self.temperature < math.inf:  # also refuses nan, as relay run does
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be at least 1, got {self.top_k}")
        if self.temperature == 0 and (self.top_p < 1 or self.top_k is not None):
            raise ValueError("--top-p and --top-k filter sampled tokens; set --temperature above 0 too")
        if self.requests < 1:
            raise ValueError(f"--requests must be at least 1, got {self.requests}")
        if not self.system_tokens or any(s < 0 for s in self.system_tokens):
            raise ValueError(f"--system-tokens must be non-negative counts, got {self.system_tokens}")
        if not self.max_batch or any(b < 1 for b in self.max_batch):
            raise ValueError(f"--max-batch values must be at least 1, got {self.max_batch}")
        bad = [s for s in self.systems if s not in SYSTEMS]
        if not self.systems or bad:
            raise ValueError(f"unknown system {bad[0] if bad else ''!r}; choose from {', '.join(SYSTEMS)}")
        if self.hf_requests is not None and self.hf_requests < 1:
            raise ValueError(f"--hf-requests must be at least 1, got {self.hf_requests}")



def run_engine(lm: LoadedModel, prefix: TokenPrefix | None, shapes: list[RequestShape], own_ids: list[list[int]],
               max_batch: int, relay: bool, kv_cache_gb: float | None, cuda_graphs: bool = True,
               overlap_steps: bool = True, sampling: dict | None = None) -> dict:
    """One measured run of the engine after a warm-up on the same engine, as a server
    warms up before it serves: the first max_batch requests with outputs cut to 128
    tokens (4 on CPU), then prefill rounds of one and of three requests (small prefills
    compile kernel variants of their own), then a capture of every CUDA graph the run
    can meet. Compiles and captures still paid inside the timed run are reported.
    sampling: temperature, top_p, top_k for every request (its seed is its index); None: greedy."""
    dev = lm.model.device
    slot = 0 if prefix else None

    def requests(cap: int | None = None, count: int | None = None) -> list[TokenRequest]:
        return [TokenRequest(i, str(i), own_ids[i],
                             SamplingOptions(max_tokens=min(r.output_len, cap or r.output_len), ignore_eos=True,
                                             seed=i, **(sampling or {})),
                             prefix_slot=slot) for i, r in enumerate(shapes[:count])]

    engine = Engine(lm, [prefix] if prefix else [],
                    EngineConfig(max_num_seqs=max_batch, relay=relay, kv_cache_gb=kv_cache_gb, cuda_graphs=cuda_graphs,
                                 overlap_steps=overlap_steps),
                    record_token_ids=True, keep_step_logs=True)
    started = time.perf_counter()
    warm = requests(128 if dev.type == "cuda" else 4, min(len(shapes), max_batch))
    sum(1 for _ in engine.generate_tokens(warm))
    for count in (1, 3):
        sum(1 for _ in engine.generate_tokens(requests(2, min(count, len(shapes)))))
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.capture_all(max_batch, max(r.input_len + r.output_len for r in shapes), [slot])
    warmup_s = time.perf_counter() - started
    engine.stats = EngineStats(graphs_available=graphs is not None, keep_logs=True)  # every step, for the roofline
    captures_before = (graphs.num_captures, graphs.capture_seconds) if graphs else (0, 0.0)
    variants_before = triton_variants()
    reqs = requests()
    allocs_before = cuda_allocator_counts(dev)
    with frozen_heap(), GcPauses() as gc_pauses:
        sync(dev)
        start = time.perf_counter()
        results = list(engine.generate_tokens(reqs))
        sync(dev)
        elapsed = time.perf_counter() - start
    allocs = {k: v - allocs_before[k] for k, v in cuda_allocator_counts(dev).items()}
    st = engine.stats
    exact = len(results) == len(shapes) and all(
        r.finish_reason == "length" and r.completion_tokens == shapes[r.row_index].output_len for r in results)
    out = {"requests": len(results), "seconds": elapsed, "warmup_s": warmup_s,
           "kv_cache_blocks": engine.runner.num_blocks, "kv_cache_block_size": engine.runner.block_size,
           "generated_tokens": st.completion_tokens,
           "exact_lengths": exact, "errors": st.errors, "preemptions": st.preemptions,
           "prefill_s": st.prefill_seconds, "decode_steps": st.decode_steps,
           "graphed_decode_steps": st.graphed_decode_steps, "eager_decode_steps": st.eager_decode_steps,
           "decode_step_s": st.decode_seconds / st.decode_steps if st.decode_steps else None,
           "decode_queries": sum(r.output_len - 1 for r in shapes),
           "decode_context_sum": sum(decode_context_sum(r.input_len, r.output_len) for r in shapes),
           "attention_impl": engine.runner.attention_impl,
           "cuda_graph_replays": graphs.num_replays if graphs else 0,
           # paid inside the timed run: what a longer warm-up (or a longer job) would not pay
           "graph_captures_in_run": graphs.num_captures - captures_before[0] if graphs else 0,
           "graph_capture_s_in_run": graphs.capture_seconds - captures_before[1] if graphs else 0.0,
           "kernel_compiles_in_run": (None if variants_before is None else triton_variants() - variants_before),
           "decode_step_p50_s": st.decode_step_p50(),
           "prefill_tokens": st.prefill_tokens, "prefill_steps": st.prefill_steps,
           "prefill_step_log": [list(x) for x in st.prefill_step_log],  # [sequences, tokens, seconds]
           "decode_step_log": [list(x) for x in st.decode_step_log],  # [sequences, own context, seconds]
           # host stalls inside the timed run: Python's cyclic GC, and the CUDA caching
           # allocator going back to the driver (a retry frees its cache first)
           "gc_collections_in_run": gc_pauses.count, "gc_pause_s_in_run": gc_pauses.seconds,
           **{f"{k}_in_run": v for k, v in allocs.items()},
           "_ids": engine.token_ids_by_row, **ttft_stats(st.ttft_seconds)}
    del engine, graphs  # the graphs hold the KV cache too: both go before the next engine sizes its own
    free_memory(dev)
    return out


class GcPauses:
    """Counts Python's garbage collections, and the time they take, while active."""

    def __enter__(self) -> "GcPauses":
        self.count, self.seconds, self._t0 = 0, 0.0, None
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None


def cuda_allocator_counts(dev) -> dict[str, int]:
    """The CUDA caching allocator's driver allocations and retries so far (empty on CPU)."""
    if dev.type != "cuda":
        return {}
    import torch
    stats = torch.cuda.memory_stats(dev)
    return {"cuda_mallocs": stats.get("num_device_alloc", 0), "cuda_alloc_retries": stats.get("num_alloc_retries", 0)}


def triton_variants() -> int | None:
    """How many Triton kernel variants relay's kernel modules have compiled in this
    process (None where Triton is absent or keeps its caches elsewhere)."""
    import sys
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("relaycli.kernels.triton_") or module is None:
            continue
        for fn in vars(module).values():
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", None)
                if caches is None:
                    return None
                total += sum(len(entry[0]) for entry in caches.values())
    return total


def median_run(runs: list[tuple[dict, dict | None]]) -> tuple[dict, dict | None]:
    """The run of median time among repeats of one system (of two middle ones, the slower),
    with every run's seconds and req/s and whether all runs generated the same ids."""
    if len(runs) == 1 or any("seconds" not in row for row, _ in runs):
        return runs[0]
    ordered = sorted(runs, key=lambda run: run[0]["seconds"])
    row, token_ids = ordered[len(ordered) // 2]
    row = {**row, "runs": len(runs), "seconds_runs": [r["seconds"] for r, _ in runs],
           "requests_per_s_runs": [r["requests_per_s"] for r, _ in runs],
           "same_ids_across_runs": all(ids == token_ids for _, ids in runs)}
    return row, token_ids


def _prepare_model(opts: E2EOptions, need_context: int) -> tuple[LoadedModel, str | None]:
    lm = load_model(opts.model, opts.dtype, opts.device, seed=opts.seed)
    limit = lm.config.max_position_embeddings
    if need_context <= limit:
        return lm, None
    if not lm.reference.startswith("dummy:"):
        raise ValueError(f"system prompt + input + output need {need_context} positions, {lm.reference} has "
                         f"{limit}; use fewer --system-tokens or a dummy model")
    # Random weights: speed does not depend on where RoPE was trained; let long prompts run.
    lm.config.max_position_embeddings = need_context
    return lm, f"context raised from {limit} to {need_context} positions (random weights)"


def run_e2e(opts: E2EOptions, progress: Callable[[str], None] | None = None) -> dict:
    say = progress or (lambda _msg: None)
    spec = get_workload(opts.workload)
    shapes = make_requests(spec, opts.requests, opts.seed, opts.max_output_len)
    need = max(opts.system_tokens) + max(r.input_len + r.output_len for r in shapes)
    lm, note = _prepare_model(opts, need)
    dev = lm.model.device
    say(f"model {lm.reference} ({str(lm.model.dtype).replace('torch.', '')}, {dev}); measuring ceilings")
    ceil = measure_ceilings(dev, lm.model.dtype)
    shape = ModelShape.from_config(lm.config, lm.model.dtype.itemsize)
    rng = random.Random(opts.seed + 1)
    vocab = lm.config.vocab_size
    own_ids = [[rng.randrange(vocab) for _ in range(r.input_len)] for r in shapes]
    sampling = (dict(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k)
                if opts.temperature > 0 else None)
    rows = []
    for s in opts.system_tokens:
        ids = [rng.randrange(vocab) for _ in range(s)]
        prefix = prefix_from_ids(lm, ids, "bench") if s else None
        for b in opts.max_batch:
            runs: dict[str, list[tuple[dict, dict | None]]] = {system: [] for system in opts.systems}
            for rep in range(opts.repeats):  # systems alternate, so a drift of the machine hits each alike
                for system in opts.systems:
                    if system == "hf" and rep:
                        continue  # the peer runs once: it is slow, and no variant of it is compared
                    base = {"system": system, "system_tokens": s, "max_batch": b, "workload": spec.name}
                    if system == "hf":
                        row = hf_row(lm, ids, shapes[:opts.hf_requests], own_ids, b, s, sampling)
                    else:
                        row = run_engine(lm, prefix, shapes, own_ids, b, system == "relay", opts.kv_cache_gb,
                                         sampling=sampling)
                    row = {**base, **row}
                    token_ids = row.pop("_ids", None)
                    if "seconds" in row:
                        price_decode(row, shape, s, ceil, input_lens=[r.input_len for r in shapes])
                    runs[system].append((row, token_ids))
                    say(e2e_line(row) + (f"  (run {rep + 1} of {opts.repeats})" if opts.repeats > 1 else ""))
            ids_by_system = {}
            for system in opts.systems:
                row, token_ids = median_run(runs[system])
                # sampled: the engines draw alike (each row's own seed), transformers does not
                ids_by_system[system] = None if sampling and system == "hf" else token_ids
                rows.append(row)
            compare_tokens(rows[-len(opts.systems):], ids_by_system)
        del prefix
        free_memory(dev)
    add_speedups(rows)
    return {"kind": "e2e", "machine": machine_info(dev), "model": lm.reference, "model_note": note,
            "dtype": str(lm.model.dtype).replace("torch.", ""),
            "ceilings": {"bandwidth_bytes_per_s": ceil.bandwidth, "matmul_flops_per_s": ceil.matmul_rate},
            "workload": {**spec.describe(), "seed": opts.seed, "requests": opts.requests,
                         "max_output_len": opts.max_output_len, "lengths": length_summary(shapes)},
            "options": {k: v for k, v in opts.__dict__.items()}, "rows": rows}

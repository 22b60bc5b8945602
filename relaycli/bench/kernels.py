"""Decode attention alone: relay against the --no-relay baseline and per-request SDPA.

One layer's decode step: B requests, one S-token system prefix shared by all, C own
keys each in a paged cache (the engine's blocks: 64 keys on CUDA, 16 elsewhere; shuffled
block table), random inputs.
  relay     system step for the whole batch + paged context step + exact fusion
  no-relay  one softmax per request over prefix + own keys (prefix read per request)
  sdpa      torch's scaled_dot_product_attention per request on contiguous KV
On CUDA with Triton the kernels are those of kernels/triton_ops.py, timed as CUDA-graph
replays (median of CUDA events, the L2 emptied before each run: relaycli/bench/timing.py,
`l2_flush`); elsewhere the pure-PyTorch
kernels/reference.py, timed by the median of repeated calls. Nothing here prints.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from relaycli.kernels import reference
from relaycli.kernels.backend import triton_available
from relaycli.kernels.metadata import AttentionMetadata, PrefixGroup
from relaycli.kernels.triton_plan import default_block_size
from relaycli.models.dummy import dummy_config
from relaycli.models.registry import resolve_device, resolve_dtype
from relaycli.bench.report import machine_info
from relaycli.bench.roofline import attention_floor, measure_ceilings
from relaycli.bench.timing import FLUSHES, cuda_median_us

KERNELS = ("relay", "no-relay", "sdpa")


@dataclass
class KernelOptions:
    model: str = "dummy:llama2-7b"  # whose head shapes (dummy presets: no weights are made)
    system_tokens: list[int] = field(default_factory=lambda: [512, 2048])
    batch: list[int] = field(default_factory=lambda: [8, 32])
    own_tokens: int = 64
    dtype: str | None = None
    device: str | None = None
    seed: int = 0
    repeats: int = 5
    l2_flush: str = "clean"  # how the L2 is emptied before each timed CUDA run (timing.FLUSHES)

    def __post_init__(self) -> None:
        if self.l2_flush not in FLUSHES:
            raise ValueError(f"--l2-flush must be one of {', '.join(FLUSHES)}, got {self.l2_flush!r}")
        if not self.model.startswith("dummy:"):
            raise ValueError("relay bench kernels takes head shapes from a dummy preset, e.g. --model dummy:llama3-8b")
        dummy_config(self.model.split(":", 1)[1])  # raises for an unknown preset
        if not self.system_tokens or any(s < 0 for s in self.system_tokens):
            raise ValueError(f"--system-tokens must be non-negative, got {self.system_tokens}")
        if not self.batch or any(b < 1 for b in self.batch):
            raise ValueError(f"--max-batch values must be at least 1, got {self.batch}")
        if self.own_tokens < 1 or self.repeats < 1:
            raise ValueError("--context and repeats must be at least 1")


def build_step(hq: int, hkv: int, d: int, batch: int, system: int, own: int, dev, dtype, gen: torch.Generator,
               page: int | None = None, lens: list[int] | None = None, max_context_len: int | None = None):
    """q [B, Hq, D], paged own KV with a shuffled block table, one shared prefix (or none).

    page: keys a cache block (None: the engine's on this device, triton_plan.default_block_size);
    lens: each row's own keys (default: own for every row; own then sizes the table);
    max_context_len: what the metadata reports as the longest, as a graph bucket does
    (default: the longest row)."""
    page = page or default_block_size(torch.device(dev))
    lens = [own] * batch if lens is None else list(lens)
    assert len(lens) == batch and min(lens) >= 1, "lens needs one positive length a row"
    per_seq = math.ceil(max(lens) / page)
    tables = torch.randperm(batch * per_seq, generator=gen, device=dev).view(batch, per_seq).to(torch.int32)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=dtype)

    k_cache, v_cache = rnd(batch * per_seq, page, hkv, d), rnd(batch * per_seq, page, hkv, d)
    q = rnd(batch, hq, d)
    last = torch.tensor(lens, device=dev, dtype=torch.int64) - 1
    slots = tables.gather(1, (last // page).view(-1, 1)).view(-1).to(torch.int64) * page + last % page
    prefixes = [(rnd(system, hkv, d), rnd(system, hkv, d))] if system else []
    rows = torch.arange(batch, device=dev)
    groups = [PrefixGroup(0, system, rows, rows)] if system else []
    meta = AttentionMetadata(True, torch.arange(batch + 1, device=dev, dtype=torch.int32), 1,
                             torch.tensor(lens, device=dev, dtype=torch.int32), max_context_len or max(lens), tables,
                             slots, page, groups)
    return q, k_cache, v_cache, prefixes, meta


def _time_cpu(fn: Callable, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_cuda(fn: Callable, flush: str = "clean") -> float:
    """Seconds of fn replayed from a CUDA graph (eager if capture fails), median."""
    fn()
    torch.cuda.synchronize()
    try:  # a throwaway capture: variants chosen only under capture (TMA, overlap) compile here
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fn()
    except Exception:  # noqa: BLE001 - the capture below reports by falling back
        pass
    torch.cuda.synchronize()
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - an op that cannot be captured is timed eagerly
        torch.cuda.synchronize()
    return cuda_median_us(run, flush) * 1e-6


def _sdpa(q, k_cache, v_cache, meta, prefixes, scale):
    """Per-request attention on contiguous [B, Hkv, S+C, D] KV (built once, outside the timing)."""
    own_k, own_v = reference.gather_context(k_cache, meta), reference.gather_context(v_cache, meta)
    b = q.shape[0]
    if prefixes:
        k_sys, v_sys = prefixes[0]
        own_k = torch.cat([k_sys[None].expand(b, -1, -1, -1), own_k], 1)
        own_v = torch.cat([v_sys[None].expand(b, -1, -1, -1), own_v], 1)
    k, v = own_k.transpose(1, 2).contiguous(), own_v.transpose(1, 2).contiguous()
    qq = q[:, :, None, :]
    gqa = q.shape[1] != k.shape[1]
    return lambda: F.scaled_dot_product_attention(qq, k, v, scale=scale, enable_gqa=gqa)[:, :, 0]


def run_kernels(opts: KernelOptions, progress: Callable[[str], None] | None = None) -> dict:
    say = progress or (lambda _msg: None)
    dev = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, dev)
    cfg = dummy_config(opts.model.split(":", 1)[1])
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    use_triton = triton_available(dev)
    ops = __import__("relaycli.kernels.triton_ops", fromlist=["x"]) if use_triton else reference
    if dev.type == "cuda":
        def time_fn(fn, _repeats):  # a median over about 100 ms of replays, whatever repeats says
            return _time_cuda(fn, opts.l2_flush)
    else:
        time_fn = _time_cpu
    say(f"heads of {opts.model}: Hq={hq} Hkv={hkv} D={d}; {dtype} on {dev} "
        f"({'Triton' if use_triton else 'PyTorch reference'} kernels); measuring ceilings")
    ceil = measure_ceilings(dev, dtype)
    gen = torch.Generator(device=dev).manual_seed(opts.seed)
    scale = d ** -0.5
    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    for s in opts.system_tokens:
        for b in opts.batch:
            q, kc, vc, pre, meta = build_step(hq, hkv, d, b, s, opts.own_tokens, dev, dtype, gen)
            floor = attention_floor(hq, hkv, d, b, s, opts.own_tokens, elem, ceil)
            fns = {"relay": lambda: ops.relay_attention(q, kc, vc, meta, pre, scale),
                   "no-relay": lambda: ops.prefix_paged_attention(q, kc, vc, meta, pre, scale)}
            sdpa_bytes = 2 * 2 * b * (s + opts.own_tokens) * hkv * d * elem
            if _fits(dev, sdpa_bytes):
                fns["sdpa"] = _sdpa(q, kc, vc, meta, pre, scale)
            base_out = fns["no-relay"]().float()
            times = {}
            for name, fn in fns.items():
                diff = ((fn().float() - base_out).norm() / base_out.norm().clamp_min(1e-30)).item()
                times[name] = time_fn(fn, opts.repeats)
                rows.append({"system": name, "system_tokens": s, "batch": b, "own_tokens": opts.own_tokens,
                             "time_us": 1e6 * times[name], "floor_us": 1e6 * floor.seconds, "bound": floor.bound,
                             "floor_fraction": floor.seconds / times[name], "rel_diff_vs_no_relay": diff,
                             "tokens_per_s": b / times[name]})
            for r in rows[-len(fns):]:
                r["speedup_vs_no_relay"] = times["no-relay"] * 1e6 / r["time_us"]
            say(f"S={s:<6d} B={b:<4d} " + "  ".join(f"{k} {1e6 * t:9.1f} us" for k, t in times.items()))
            del q, kc, vc, pre, meta, fns
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return {"kind": "kernels", "machine": machine_info(dev), "impl": "triton" if use_triton else "torch",
            "heads": {"model": opts.model, "q_heads": hq, "kv_heads": hkv, "head_dim": d},
            "dtype": str(dtype).replace("torch.", ""),
            "ceilings": {"bandwidth_bytes_per_s": ceil.bandwidth, "matmul_flops_per_s": ceil.matmul_rate},
            "options": dict(opts.__dict__), "rows": rows}


def _fits(dev: torch.device, nbytes: int) -> bool:
    """Contiguous per-request KV only when it takes under 40% of free memory (and 1 GiB on CPU)."""
    if dev.type == "cuda":
        return nbytes < 0.4 * torch.cuda.mem_get_info(dev)[0]
    return nbytes < (1 << 30)


"""GPU timing with the L2 emptied before every measured run, without charging the run
for the emptying.

`triton.testing.do_bench` empties the L2 by zeroing a 256 MB buffer before each run. That
leaves every L2 line dirty, so the timed kernel's first reads evict lines that must be
written back to HBM first: up to a whole L2 of extra writes inside the timed region,
charged to a kernel that wrote none of it.
In a decode step the kernels before attention leave the L2 holding mostly clean lines
(weights they read), so `flush="clean"` empties it by *reading* a buffer larger than the
L2 and charges the run only for its own traffic. `flush="dirty"` reproduces do_bench.
"""

from __future__ import annotations

import statistics
from typing import Callable

FLUSHES = ("clean", "dirty")
_FLUSH_BYTES = 256 << 20  # several times any current L2


def l2_flusher(flush: str) -> Callable[[], None]:
    """A function that empties the L2 the way `flush` names (see the module)."""
    import torch
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {', '.join(FLUSHES)}, got {flush!r}")
    buf = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    buf.random_()  # never time on zeros
    if flush == "dirty":
        return buf.zero_
    return lambda: buf.sum(dtype=torch.int64)  # reads 256 MB, writes 8 bytes


def cuda_median_us(run: Callable[[], object], flush: str | Callable[[], None] = "clean",
                   warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median GPU microseconds of run() (a graph replay, say) over about rep_ms of runs,
    each timed with CUDA events after the L2 was emptied (`flush`: a name, see the module,
    or a function that does it)."""
    import torch
    empty_l2 = flush if callable(flush) else l2_flusher(flush)

    # Estimate one run's time to size the warm-up and the repeats, as do_bench does.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        empty_l2()
        run()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        run()
    reps = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        empty_l2()
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def replayed(fn: Callable[[], object]):
    """fn's result through a CUDA graph's replay (after one eager warm-up call): the paths a
    step takes only under capture, as the engine's decode graphs run them."""
    import torch
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out

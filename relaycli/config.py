"""Engine configuration, validated where it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaycli.errors import ConfigError


@dataclass
class EngineConfig:
    max_num_seqs: int = 64  # sequences in flight (--max-batch)
    max_num_batched_tokens: int = 8192  # prompt tokens one prefill step may take
    min_prefill_seqs: int | None = None  # free slots that start a prefill round; None: max_num_seqs // 8
    block_size: int | None = None  # own keys a KV cache block; None: relaycli.kernels.triton_plan.default_block_size
    kv_cache_gb: float | None = None  # None: a share of free memory
    prefix_cache_gb: float | None = None  # module paths' shared KV; None: room for the libraries' paths, grown
    kv_cache_memory_fraction: float = 0.9  # of free GPU memory after weights
    relay: bool = True  # False: the --no-relay baseline
    attention_impl: str = "auto"  # auto | torch | cpu-flash | triton
    cuda_graphs: bool = True  # decode steps through CUDA graphs (CUDA + triton only)
    overlap_steps: bool = True  # read a step's tokens back while the next one runs (same outputs)
    max_pending_rows: int | None = None  # rows read ahead of the batch; None: 4 x max_num_seqs

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-batch must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_gb is not None and not 0 < self.kv_cache_gb < math.inf:
            raise ConfigError(f"--kv-cache-gb must be a positive number of GiB, got {self.kv_cache_gb}")
        if self.prefix_cache_gb is not None and not 0 < self.prefix_cache_gb < math.inf:
            raise ConfigError(f"--prefix-cache-gb must be a positive number of GiB, got {self.prefix_cache_gb}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ConfigError("kv_cache_memory_fraction must be in (0, 1]")
        if self.attention_impl not in ("auto", "torch", "cpu-flash", "triton"):
            raise ConfigError(f"--attention-impl must be auto, torch, cpu-flash or triton, got {self.attention_impl!r}")
        if self.min_prefill_seqs is None:
            self.min_prefill_seqs = max(1, self.max_num_seqs // 8)
        if not 1 <= self.min_prefill_seqs <= self.max_num_seqs:
            raise ConfigError(f"min_prefill_seqs must be in [1, {self.max_num_seqs}], got {self.min_prefill_seqs}")
        if self.max_pending_rows is None:
            self.max_pending_rows = 4 * self.max_num_seqs

"""The roofline model of a decode step, and the two ceilings it is held against.

A decode step of a batch of B requests that share one S-token system prompt, whose own
contexts hold C_1..C_B tokens (this step's token included), must at least

    read   W                    the weights (every linear layer, lm_head, the norms)
         + kv * S               the system prompt's KV, once for the whole batch
         + kv * sum(C_i)        each request's own KV
    do     2 * P * B            the matrix products of the weights (P their parameters)
         + 4 * L * Hq * D * (B * S + sum(C_i))    attention, q.k and p.v

with kv = 2 * L * Hkv * D * dtype_bytes per token. Its floor is
max(bytes / bandwidth, flops / matmul rate): no step can be faster. Bandwidth is
measured as a large device copy, counting bytes read plus bytes written, and the rate
as a large matrix product in the run dtype, both in the same run as the benchmark.
The fraction of the floor a system reaches is floor / its measured step time.
Everything but `measure_ceilings` is plain arithmetic (tested by hand).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError("q_heads must be a multiple of kv_heads")

    @classmethod
    def from_config(cls, cfg, dtype_bytes: int) -> "ModelShape":
        """From a relaycli.models.config.ModelConfig (or anything with its field names)."""
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, dtype_bytes)

    @property
    def matmul_params(self) -> int:
        """Parameters of the matrix products of one token: q, k, v, o, gate, up, down, lm_head."""
        q = self.q_heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        per_layer = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """Bytes a step reads of the weights: matmul weights and norm weights (the
        embedding table itself only gives B rows, negligible, unless tied = lm_head)."""
        norms = (2 * self.layers + 1) * self.hidden
        return (self.matmul_params + norms) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s, read + write of a large copy
    matmul_rate: float  # flop/s of a large matrix product in the run dtype

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.matmul_rate <= 0:
            raise ValueError("ceilings must be positive")


@dataclass(frozen=True)
class Floor:
    bytes: float
    flops: float
    seconds: float
    bound: str  # "bytes" or "flops"


def floor_of(nbytes: float, flops: float, ceil: Ceilings) -> Floor:
    t_bytes, t_flops = nbytes / ceil.bandwidth, flops / ceil.matmul_rate
    return Floor(nbytes, flops, max(t_bytes, t_flops), "bytes" if t_bytes >= t_flops else "flops")


def decode_step_floor(shape: ModelShape, batch: float, system_tokens: int, context_tokens: float,
                      ceil: Ceilings, system_once: bool = True) -> Floor:
    """Floor of one decode step. batch: requests in the step; context_tokens: the sum of
    their own context lengths. Both may be means over a run's steps (cost is linear).
    system_once=False counts the system KV once per request (what --no-relay reads)."""
    if batch <= 0 or system_tokens < 0 or context_tokens < 0:
        raise ValueError("batch must be positive, token counts non-negative")
    sys_reads = 1 if system_once else batch
    nbytes = shape.weight_bytes + shape.kv_bytes_per_token * (sys_reads * system_tokens + context_tokens)
    attn = 4 * shape.layers * shape.q_heads * shape.head_dim * (batch * system_tokens + context_tokens)
    return floor_of(nbytes, 2 * shape.matmul_params * batch + attn, ceil)


def attention_floor(q_heads: int, kv_heads: int, head_dim: int, batch: int, system_tokens: int,
                    own_tokens: int, dtype_bytes: int, ceil: Ceilings) -> Floor:
    """Floor of one layer's decode attention: system KV once, own KV, q in and o out."""
    kv = 2 * kv_heads * head_dim * dtype_bytes
    nbytes = kv * (system_tokens + batch * own_tokens) + 2 * batch * q_heads * head_dim * dtype_bytes
    return floor_of(nbytes, 4 * batch * q_heads * head_dim * (system_tokens + own_tokens), ceil)


def decode_context_sum(input_len: int, output_len: int) -> int:
    """Sum over a request's decode steps of its own context length: the first token comes
    from prefill, decode step j (1..output_len-1) attends input_len + j own tokens."""
    steps = output_len - 1
    return steps * input_len + steps * (steps + 1) // 2


def prefill_floor(shape: ModelShape, system_tokens: int, input_lens, ceil: Ceilings) -> Floor:
    """Floor of prefilling requests' own inputs after an S-token shared prefix: every
    input token goes through the layers' products and attends to the prefix and to its
    own earlier tokens; only each request's last token goes through the lm_head (the
    engine computes no other prefill logits). Bytes: the weights once (prefill is bound
    by flops)."""
    own = sum(input_lens)
    causal = sum(n * (n + 1) // 2 for n in input_lens)
    attn = 4 * shape.layers * shape.q_heads * shape.head_dim * (own * system_tokens + causal)
    head = shape.vocab * shape.hidden
    return floor_of(shape.weight_bytes, 2 * (shape.matmul_params - head) * own + 2 * head * len(input_lens) + attn,
                    ceil)


LARGE_BATCH = 64  # decode steps of this batch and more are held to their floor (docs/benchmarks.md)


def price_decode(row: dict, shape: ModelShape, system_tokens: int, ceil: Ceilings,
                 input_lens: list[int] | None = None) -> dict:
    """Add rates and the floor of the mean decode step to a run's row: decode_queries /
    decode_steps is the mean batch, decode_context_sum / decode_steps its context sum.
    Where the row logs every decode step ([batch, own context sum, seconds], the
    engine's), the steps of LARGE_BATCH requests or more are also priced one by one:
    large_batch_floor_fraction is their floors' sum over their times' sum. With the
    requests' input lengths too, the whole job is priced (job_floor_*)."""
    row["requests_per_s"] = row["requests"] / row["seconds"]
    row["tokens_per_s"] = row["generated_tokens"] / row["seconds"]
    if row.get("decode_steps") and row.get("decode_queries"):
        steps = row["decode_steps"]
        f = decode_step_floor(shape, row["decode_queries"] / steps, system_tokens,
                              row["decode_context_sum"] / steps, ceil)
        row.update(mean_decode_batch=row["decode_queries"] / steps, floor_step_s=f.seconds, floor_bound=f.bound,
                   floor_bytes=f.bytes, floor_flops=f.flops, floor_fraction=f.seconds / row["decode_step_s"])
    log = row.get("decode_step_log") or ()
    if log and row.get("max_batch"):
        row["decode_steps_by_batch"] = steps_by_batch(log, row["max_batch"], shape, system_tokens, ceil)
    floors = [decode_step_floor(shape, b, system_tokens, c, ceil).seconds for b, c, _ in log]  # one a step
    if log and input_lens is not None:
        # The job's floor: its prefill and every decode step at their floors. The
        # engine's own work, so no schedule or overlap can beat it (ceilings permitting).
        job = prefill_floor(shape, system_tokens, input_lens, ceil).seconds + sum(floors)
        row.update(job_floor_s=job, job_floor_requests_per_s=row["requests"] / job,
                   job_floor_fraction=job / row["seconds"])
    large = [(floor, s) for (b, _, s), floor in zip(log, floors) if b >= LARGE_BATCH]
    if large:
        seconds = sum(s for _, s in large)
        row.update(large_batch_steps=len(large), large_batch_step_s=seconds / len(large),
                   large_batch_floor_fraction=sum(f for f, _ in large) / seconds if seconds > 0 else None)
    return row


STEP_BINS = 16  # batch ranges of steps_by_batch: the table folds them four to a row


def step_bin_width(max_batch: int, num_bins: int = STEP_BINS) -> int:
    return max(1, -(-max_batch // num_bins))


def steps_by_batch(log, max_batch: int, shape: ModelShape, system_tokens: int, ceil: Ceilings,
                   num_bins: int = STEP_BINS) -> list[dict]:
    """Decode steps grouped by batch size into num_bins equal ranges of 1..max_batch:
    per range, its steps' count, median and mean time, mean batch and own context, and
    the floor of a step of that mean batch and context. A job's tail (its last, long
    requests decoding in small batches) shows up as many steps in the low ranges."""
    width = step_bin_width(max_batch, num_bins)
    groups: dict[int, list] = {}
    for b, c, sec in log:
        groups.setdefault((b - 1) // width, []).append((b, c, sec))
    out = []
    for k in sorted(groups):
        steps = groups[k]
        times = sorted(sec for _, _, sec in steps)
        batch = sum(b for b, _, _ in steps) / len(steps)
        context = sum(c for _, c, _ in steps) / len(steps)
        out.append(dict(batch_from=k * width + 1, batch_to=min((k + 1) * width, max_batch), steps=len(steps),
                        step_p50_s=times[len(times) // 2], step_mean_s=sum(times) / len(times),
                        mean_batch=batch, mean_context=context,
                        floor_s=decode_step_floor(shape, batch, system_tokens, context, ceil).seconds))
    return out


def measure_ceilings(device, dtype, copy_bytes: int | None = None, matmul_n: int | None = None,
                     repeats: int = 5) -> Ceilings:
    """Best of `repeats`: a device copy (GiB-scale on CUDA) and an n^3 matrix product."""
    import torch
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    copy_bytes = copy_bytes or (1 << 30 if cuda else 1 << 28)
    matmul_n = matmul_n or (8192 if cuda else 1024)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return min(times)

    elem = torch.empty((), dtype=dtype).element_size()
    src = torch.ones(copy_bytes // elem, dtype=dtype, device=dev)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * elem / best(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(matmul_n, matmul_n, device=dev).to(dtype)
    b = torch.randn(matmul_n, matmul_n, device=dev).to(dtype)
    rate = 2 * matmul_n ** 3 / best(lambda: a @ b)
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return Ceilings(bandwidth, rate)

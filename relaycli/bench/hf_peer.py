"""The outside peer of `relay bench e2e`: transformers' `generate`, batched, on relay's
own weights, with the system prompt's KV computed once and copied into every batch's
cache (as fair as it can be made). Also the device helpers both sides use.
"""

from __future__ import annotations

import copy
import gc
import time

import torch

from relaycli.models.registry import LoadedModel
from relaycli.bench.report import ttft_stats
from relaycli.bench.roofline import ModelShape, decode_context_sum
from relaycli.bench.workloads import RequestShape


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()  # free the engine's KV cache before the next engine sizes its own
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_twin(lm: LoadedModel):
    """A transformers Llama holding relay's own weight tensors (assigned, not copied);
    None when the architecture has parts a plain Llama lacks (biases, q/k norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = lm.config
    if c.qkv_bias or c.o_bias or c.qk_norm:
        return None
    rope = {"rope_type": "default", "rope_theta": c.rope_theta} if c.rope_scaling is None else \
        dict(c.rope_scaling, rope_theta=c.rope_theta)
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                      rope_parameters=rope, tie_word_embeddings=c.tie_word_embeddings, pad_token_id=0)
    with torch.device(lm.model.device):
        hf = LlamaForCausalLM._from_config(cfg, dtype=lm.model.dtype)
    missing, unexpected = hf.load_state_dict(lm.model.state_dict(), strict=False, assign=True)
    missing = [m for m in missing if "rotary" not in m and not (m == "lm_head.weight" and c.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"transformers twin: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    # No end-of-sequence token: like relay's ignore_eos, the argmax is kept even when it
    # is EOS (min_new_tokens alone would mask EOS and change the greedy path).
    hf.generation_config.eos_token_id = None
    return hf.eval()


class _StepClock:
    """A logits processor that notes when each generation step's logits are ready."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def hf_batch_limit(lm: LoadedModel, max_batch: int, tokens_per_request: int) -> int:
    """The largest batch <= max_batch whose per-request KV copies fit in memory."""
    shape = ModelShape.from_config(lm.config, lm.model.dtype.itemsize)
    dev = lm.model.device
    if dev.type == "cuda":
        budget = 0.7 * torch.cuda.mem_get_info(dev)[0]
    else:
        import os
        budget = 0.4 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(max_batch, int(budget // (shape.kv_bytes_per_token * tokens_per_request))))


@torch.inference_mode()
def run_hf(lm: LoadedModel, hf, prefix_ids: list[int], shapes: list[RequestShape], own_ids: list[list[int]],
           batch: int, sampling: dict | None = None) -> dict:
    """Static batches of `batch` requests in order. The system prompt's KV is computed once
    (untimed, like compile-prompt) and copied into each batch's cache; each row is the
    system part, then masked left padding, then its own tokens, so the positions generate
    derives from the mask are those of the unpadded prompt. A batch runs to its longest
    output; only each request's own output length counts as generated. sampling:
    temperature, top_p, top_k for generate's own sampler (None: greedy)."""
    import inspect

    from transformers import DynamicCache, LogitsProcessorList
    # transformers 5.x renamed past_key_values to cache; take whichever this version has.
    params = inspect.signature(type(hf).forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    # top_k=0 turns off generate's default top-k of 50, which relay does not apply
    draw = (dict(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"],
                 top_k=sampling["top_k"] or 0) if sampling else dict(do_sample=False))
    dev = lm.model.device
    s = len(prefix_ids)
    cache = None
    if s:
        cache = DynamicCache()
        hf(torch.tensor([prefix_ids], device=dev), use_cache=True, **last_only, **{kw: cache})
    warm = torch.tensor([prefix_ids + own_ids[0][:4]], device=dev)
    hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                pad_token_id=0, **{kw: copy.deepcopy(cache)})
    ttft, steps, step_s, queries, ctx_sum, useful, computed, got = [], 0, 0.0, 0, 0, 0, 0, {}
    sync(dev)
    start = time.perf_counter()
    for lo in range(0, len(shapes), batch):
        part = range(lo, min(lo + batch, len(shapes)))
        width = max(shapes[i].input_len for i in part)
        new = max(shapes[i].output_len for i in part)
        ids = torch.tensor([prefix_ids + [0] * (width - shapes[i].input_len) + own_ids[i] for i in part], device=dev)
        mask = torch.tensor([[1] * s + [0] * (width - shapes[i].input_len) + [1] * shapes[i].input_len
                             for i in part], device=dev)
        t0 = time.perf_counter()
        past = None
        if cache is not None:
            past = copy.deepcopy(cache)
            past.batch_repeat_interleave(len(part))
        clock = _StepClock(dev)
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **draw,
                          logits_processor=LogitsProcessorList([clock]), pad_token_id=0, **{kw: past})
        if out.shape[1] - ids.shape[1] != new:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, asked for {new}")
        for k, i in enumerate(part):
            got[i] = out[k, ids.shape[1]:ids.shape[1] + shapes[i].output_len].tolist()
        ttft += [clock.times[0] - t0] * len(part)
        steps += new - 1
        step_s += clock.times[-1] - clock.times[0]
        queries += len(part) * (new - 1)
        ctx_sum += len(part) * decode_context_sum(width, new)
        useful += sum(shapes[i].output_len for i in part)
        computed += len(part) * new
        del past, out
    sync(dev)
    elapsed = time.perf_counter() - start
    return {"requests": len(shapes), "seconds": elapsed, "generated_tokens": useful, "computed_tokens": computed,
            "exact_lengths": True, "hf_batch": batch, "decode_steps": steps,
            "decode_step_s": step_s / steps if steps else None, "decode_queries": queries,
            "decode_context_sum": ctx_sum, "_ids": got, **ttft_stats(ttft)}


def hf_row(lm: LoadedModel, prefix_ids: list[int], shapes: list[RequestShape], own_ids: list[list[int]],
            max_batch: int, s: int, sampling: dict | None = None) -> dict:
    hf = hf_twin(lm)
    if hf is None:
        return {"skipped": f"transformers twin not available for {lm.config.architecture} with biases/norms"}
    # no wider than the requests it has: the table names the batch that generate ran
    batch = min(len(shapes), hf_batch_limit(lm, max_batch, s + max(r.input_len + r.output_len for r in shapes)))
    try:
        while True:
            try:
                return run_hf(lm, hf, prefix_ids, shapes, own_ids, batch, sampling)
            except torch.cuda.OutOfMemoryError:
                free_memory(lm.model.device)
                if batch == 1:
                    return {"skipped": "transformers ran out of memory at batch 1"}
                batch //= 2
    finally:
        del hf
        free_memory(lm.model.device)

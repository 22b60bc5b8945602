"""Putting named tensors into a CausalLM, with one clear sentence for what is wrong."""

from __future__ import annotations

from typing import Iterable

import torch

from models.llama import CausalLM


class WeightError(ValueError):
    """Missing, unexpected or mis-shaped weight tensors."""


def expected_names(model: CausalLM) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters()}


def assign_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy each (name, tensor) into the model, casting to the model's dtype.

    Tied checkpoints may also carry lm_head.weight; it is ignored when the model ties
    its head to the embedding. Everything the model needs must be present.
    """
    params = expected_names(model)
    seen: set[str] = set()
    for name, tensor in tensors:
        if name not in params:
            if name == "lm_head.weight" and model.lm_head is None:
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store the RoPE table; it is derived from config
            raise WeightError(f"{source}: unexpected weight tensor {name!r} for {model.config.architecture}")
        param = params[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightError(
                f"{source}: weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise WeightError(f"{source}: missing weight tensors {', '.join(missing[:3])}{more}")


def init_random_weights(model: CausalLM, seed: int) -> None:
    """Random weights at the scale real checkpoints have, so activations stay finite."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)

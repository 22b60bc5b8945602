"""Putting named tensors into a CausalLM, with one clear sentence for what is wrong; and
relay's own weights files: safetensors in the model's storage layout, memory-mapped.

A weights file relay writes (the converted-model cache) holds each fused projection as
one tensor under its storage name (model.layers.N.self_attn.qkv.weight: q, k and v rows
in the order the forward multiplies them), every tensor 64-byte aligned in the file. So
a cached model in the cache's dtype on the CPU uses the mapped bytes as its parameters:
nothing is copied, and the pages are read when a forward first touches them.
"""

from __future__ import annotations

from relaycli.errors import RelayError
import json
import mmap
import struct
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from relaycli.models.llama import CausalLM

# Matrix kernels (MKL) may round differently for operands at other alignments; torch's
# CPU allocator gives 64 bytes, so a tensor used in place must be aligned as well.
ALIGN = 64
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_BY_ST = {v: k for k, v in _ST_DTYPES.items()}


class WeightError(RelayError):
    """Missing, unexpected or mis-shaped weight tensors."""


def expected_names(model: CausalLM) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters()}


def _shareable(tensor: torch.Tensor, target: torch.Tensor) -> bool:
    return (tensor.dtype == target.dtype and tensor.device == target.device and tensor.is_contiguous()
            and tensor.data_ptr() % ALIGN == 0)


def _fused_parts(model: CausalLM) -> dict[str, tuple[object, list[str]]]:
    """Storage name -> (FusedLinear, full names of its part modules)."""
    out = {}
    for name, fused in model.fused_linears().items():
        parent = name.rpartition(".")[0]
        out[name] = (fused, [f"{parent}.{part}" for part in fused.part_names])
    return out


def assign_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str,
                   share: bool = False) -> None:
    """Put each (name, tensor) into the model, casting to the model's dtype.

    Names are transformers' (q_proj, k_proj, ...) or a fused projection's storage name
    (self_attn.qkv, mlp.gate_up). With share, a tensor that already has the parameter's
    dtype and device (and is contiguous and aligned) becomes the parameter itself, not
    a copy: only for tensors nobody else writes, such as a private mapping of a file.
    Tied checkpoints may also carry lm_head.weight; it is ignored when the model ties
    its head to the embedding. Everything the model needs must be present.
    """
    params = expected_names(model)
    fused = _fused_parts(model)
    part_params = {f"{p}.{leaf}" for _, parts in fused.values() for p in parts for leaf in ("weight", "bias")}
    seen: set[str] = set()
    for name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".")
        if prefix in fused and leaf in ("weight", "bias") and getattr(fused[prefix][0], leaf) is not None:
            linear, parts = fused[prefix]
            target = getattr(linear, leaf)
            _check_shape(source, name, tensor, target)
            if share and _shareable(tensor, target):
                linear.adopt(leaf, tensor)
            else:
                with torch.no_grad():
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            seen.update(f"{p}.{leaf}" for p in parts)
            continue
        if name not in params:
            if name == "lm_head.weight" and model.lm_head is None:
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store the RoPE table; it is derived from config
            raise WeightError(f"{source}: unexpected weight tensor {name!r} for {model.config.architecture}")
        param = params[name]
        _check_shape(source, name, tensor, param)
        if share and name not in part_params and _shareable(tensor, param):
            setattr(model.get_submodule(prefix), leaf, nn.Parameter(tensor, requires_grad=False))
        else:
            with torch.no_grad():
                param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise WeightError(f"{source}: missing weight tensors {', '.join(missing[:3])}{more}")


def _check_shape(source: str, name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise WeightError(f"{source}: weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")


def storage_layout(model: CausalLM, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """tensors (transformers' names) with each fused projection's parts joined into one
    tensor under its storage name, as the model holds them; other tensors as they are."""
    out = dict(tensors)
    for name, (_, parts) in _fused_parts(model).items():
        for leaf in ("weight", "bias"):
            names = [f"{p}.{leaf}" for p in parts]
            if all(n in out for n in names):
                out[f"{name}.{leaf}"] = torch.cat([out.pop(n) for n in names])
    return out


def save_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file whose tensors all start 64-byte aligned where their sizes allow:
    the header is padded to the alignment and tensors of aligned sizes come first."""
    order = sorted(tensors, key=lambda n: ((tensors[n].numel() * tensors[n].element_size()) % ALIGN != 0, n))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise WeightError(f"{path}: cannot store {name!r} of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-(8 + len(head)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in order:
            t = tensors[name].detach().to("cpu").contiguous()
            if t.numel():
                f.write(memoryview(t.view(torch.uint8).numpy()))


def header_length(path: Path) -> int:
    """Bytes before a safetensors file's tensor data (the length field and the header)."""
    with open(path, "rb") as f:
        raw = f.read(8)
    if len(raw) < 8:
        raise WeightError(f"{path}: truncated safetensors file")
    return 8 + struct.unpack("<Q", raw)[0]


def map_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view of one private (copy-on-write) memory
    map of it: no bytes are read or copied here, and no write reaches the file. A header
    that does not describe the file exactly is refused (WeightError)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    if mm is None or size < 8:
        raise WeightError(f"{path}: truncated safetensors file")
    (head_len,) = struct.unpack("<Q", mm[:8])
    if head_len > size - 8:
        raise WeightError(f"{path}: the safetensors header runs past the end of the file")
    try:
        header = json.loads(bytes(mm[8:8 + head_len]))
        header.pop("__metadata__", None)
        entries = sorted(((tuple(info["data_offsets"]), name, info) for name, info in header.items()),
                         key=lambda e: e[0])
        if not all(len(e[0]) == 2 and all(isinstance(x, int) for x in e[0]) for e in entries):
            raise ValueError("data_offsets")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise WeightError(f"{path}: unreadable safetensors header") from None
    base, offset, out = 8 + head_len, 0, {}
    for (start, end), name, info in entries:
        dtype = _BY_ST.get(info.get("dtype"))
        shape = info.get("shape")
        if dtype is None or start != offset or not isinstance(shape, list) \
                or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WeightError(f"{path}: safetensors entry {name!r} is malformed")
        count = 1
        for dim in shape:
            count *= dim
        if not isinstance(end, int) or end - start != count * dtype.itemsize or base + end > size:
            raise WeightError(f"{path}: safetensors entry {name!r} does not fit its shape {shape} or the file")
        out[name] = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start).view(shape) \
            if count else torch.empty(shape, dtype=dtype)
        offset = end
    if base + offset != size:
        raise WeightError(f"{path}: {size} bytes, the header describes {base + offset}: truncated or padded")
    return out


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

""".relaykv: a compiled system prompt's KV, as a safetensors file (no pickle, mmap-able).

Tensors `layers.{i}.k` / `layers.{i}.v`, each [num_tokens, num_kv_heads, head_dim], keys
after RoPE. All metadata is one JSON object under the safetensors metadata key "relay".
Format 1 holds one segment, the system prompt at positions 0..S-1; `segments` already
lists it by name and position range so that a later format can hold several (Prompt
Cache modules) without changing how format-1 files read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from relaycli import __version__

FORMAT_VERSION = 1
META_KEY = "relay"
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ArtifactError(ValueError):
    """A missing, corrupt or mismatched artifact; the message is one sentence with the fix."""


@dataclass
class Artifact:
    path: Path
    meta: dict
    keys: list[torch.Tensor]  # per layer [S, Hkv, D]
    values: list[torch.Tensor]

    @property
    def name(self) -> str:
        return self.path.name[: -len(".relaykv")] if self.path.name.endswith(".relaykv") else self.path.stem

    @property
    def token_ids(self) -> list[int]:
        return self.meta["token_ids"]

    @property
    def system_text(self) -> str:
        return self.meta["system_text"]

    @property
    def num_tokens(self) -> int:
        return len(self.meta["token_ids"])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype


def _tensor_order(num_layers: int) -> list[str]:
    return [f"layers.{i}.{kv}" for i in range(num_layers) for kv in ("k", "v")]


def save_artifact(path: Path, keys: list[torch.Tensor], values: list[torch.Tensor], meta: dict) -> int:
    """Write atomically (temp file in the same folder, fsync, rename). Returns bytes written.

    meta: everything but format_version, relay_version, checksum and segments, which
    are filled in here."""
    path = Path(path)
    tensors = {}
    for i, (k, v) in enumerate(zip(keys, values)):
        tensors[f"layers.{i}.k"] = k.detach().to("cpu").contiguous()
        tensors[f"layers.{i}.v"] = v.detach().to("cpu").contiguous()
    digest = hashlib.sha256()
    for name in _tensor_order(len(keys)):
        digest.update(tensors[name].view(torch.uint8).numpy().tobytes() if tensors[name].numel() else b"")
    full = dict(meta, format_version=FORMAT_VERSION, relay_version=__version__,
                checksum="sha256:" + digest.hexdigest(),
                segments=[{"name": "system", "start": 0, "end": len(meta["token_ids"])}])
    header: dict = {"__metadata__": {META_KEY: json.dumps(full, sort_keys=True)}}
    offset = 0
    for name in _tensor_order(len(keys)):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # keep tensor data 8-byte aligned for mmap views
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for name in _tensor_order(len(keys)):
                f.write(tensors[name].view(torch.uint8).numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_artifact(path: Path, verify_checksum: bool = True) -> Artifact:
    """Memory-map and parse; refuse anything truncated, corrupt or of another format."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such artifact; make one with `relay compile-prompt`")
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise ArtifactError(f"{path}: truncated ({size} bytes), not a .relaykv artifact; recompile it")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (head_len,) = struct.unpack("<Q", mm[:8])
    if head_len > size - 8:
        raise ArtifactError(f"{path}: truncated or not a .relaykv artifact (header runs past the end); recompile it")
    try:
        header = json.loads(bytes(mm[8:8 + head_len]))
        meta = json.loads(header.pop("__metadata__")[META_KEY])
    except (ValueError, KeyError, TypeError):
        raise ArtifactError(f"{path}: not a .relaykv artifact (no relay metadata); recompile it") from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: artifact format {version} is not the format this relay reads "
                            f"({FORMAT_VERSION}); recompile it with this relay version")
    base = 8 + head_len
    num_layers = int(meta.get("num_layers", 0))
    names = _tensor_order(num_layers)
    if sorted(header) != sorted(names):
        raise ArtifactError(f"{path}: tensor list does not match its metadata; recompile it")
    end = max((header[n]["data_offsets"][1] for n in names), default=0)
    if base + end != size:
        raise ArtifactError(f"{path}: size {size} bytes, expected {base + end}: truncated or padded; recompile it")
    tensors = {}
    for name in names:
        info = header[name]
        lo, hi = info["data_offsets"]
        dtype = _FROM_ST.get(info["dtype"])
        if dtype is None:
            raise ArtifactError(f"{path}: unsupported tensor dtype {info['dtype']}; recompile it")
        count = (hi - lo) // torch.empty((), dtype=dtype).element_size()
        if count:
            with warnings.catch_warnings():  # read-only map: the tensors are never written
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + lo)
        else:
            flat = torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(info["shape"])
    if verify_checksum:
        digest = hashlib.sha256(memoryview(mm)[base:base + end]).hexdigest()
        if "sha256:" + digest != meta.get("checksum"):
            raise ArtifactError(f"{path}: checksum mismatch, the file is corrupt; recompile it")
    keys = [tensors[f"layers.{i}.k"] for i in range(num_layers)]
    values = [tensors[f"layers.{i}.v"] for i in range(num_layers)]
    return Artifact(path, meta, keys, values)


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]

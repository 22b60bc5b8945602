""".relaykv: a compiled system prompt's KV, as a safetensors file (no pickle, mmap-able).

Tensors `layers.{i}.k` / `layers.{i}.v`, each [num_tokens, num_kv_heads, head_dim], keys
after RoPE. All metadata is one JSON object under the safetensors metadata key "relay".
Format 1 holds one segment, the system prompt at positions 0..S-1. Format 2, a prompt-module
library (relaycli.modules), holds the system segment and then one segment per module, each
with its rows, token ids, position range and what it was computed after
(relaycli.segments); `token_ids` and `system_text` stay the system prompt's, so a library
serves rows without modules as a format-1 artifact does.

`checksum` covers the tensor bytes; `meta_checksum` covers the rest of the metadata (the
canonical JSON of every other field), so that an edited system text or token list is
caught as surely as a flipped KV byte.
"""

from __future__ import annotations

from relaycli.errors import RelayError, clipped
import hashlib
import json
import mmap
import os
import struct
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from relaycli import __version__
from relaycli.segments import num_rows, segment_problem, system_segment

FORMAT_VERSION = 1
LIBRARY_FORMAT_VERSION = 2
FORMAT_VERSIONS = (FORMAT_VERSION, LIBRARY_FORMAT_VERSION)
META_KEY = "relay"
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}


class ArtifactError(RelayError):
    """A missing, corrupt or mismatched artifact; the message is one sentence with the fix."""


class ChecksumError(ArtifactError):
    """The file parses but its bytes are not the ones written: `relay inspect` still shows it."""


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

    @property
    def is_library(self) -> bool:
        """A prompt-module library (format 2): its KV rows past num_tokens are modules."""
        return self.meta["format_version"] == LIBRARY_FORMAT_VERSION


def _tensor_order(num_layers: int) -> list[str]:
    return [f"layers.{i}.{kv}" for i in range(num_layers) for kv in ("k", "v")]


def _meta_digest(meta: dict) -> str:
    rest = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return "sha256:" + hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it
    os.umask(mask)
    return mask


def save_artifact(path: Path, keys: list[torch.Tensor], values: list[torch.Tensor], meta: dict,
                  modules: list[dict] | None = None) -> int:
    """Write atomically (temp file in the same folder, fsync, rename). Returns bytes written.

    meta: everything but format_version, relay_version, checksum, segments and
    meta_checksum, which are filled in here. modules: a library's module segments
    (format 2; meta then also holds "schema"), their rows after the system prompt's."""
    path = Path(path)
    tensors = {}
    for i, (k, v) in enumerate(zip(keys, values)):
        tensors[f"layers.{i}.k"] = k.detach().to("cpu").contiguous()
        tensors[f"layers.{i}.v"] = v.detach().to("cpu").contiguous()
    digest = hashlib.sha256()
    for name in _tensor_order(len(keys)):
        digest.update(tensors[name].view(torch.uint8).numpy().tobytes() if tensors[name].numel() else b"")
    library = modules is not None
    full = dict(meta, format_version=LIBRARY_FORMAT_VERSION if library else FORMAT_VERSION,
                relay_version=__version__, checksum="sha256:" + digest.hexdigest(),
                segments=[system_segment(len(meta["token_ids"]), library)] + list(modules or []))
    # Digest what a reader will parse, not the caller's objects (tuples, non-str keys).
    full = json.loads(json.dumps(full))
    full["meta_checksum"] = _meta_digest(full)
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
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes it 0600; this is a normal output file
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


_STR_FIELDS = ("model_reference", "model_fingerprint", "tokenizer_fingerprint", "chat_template_fingerprint",
               "relay_version", "checksum", "system_text")
_DIM_FIELDS = ("num_layers", "num_kv_heads", "head_dim")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bad(path: Path, what: str) -> ArtifactError:
    return ArtifactError(f"{path}: {what}; the file is damaged or not made by relay, recompile it")


def _not_artifact(path: Path, why: str) -> ArtifactError:
    """A file that holds no artifact at all: most often a system prompt's text given where
    its compiled .relaykv belongs, so the fix names the command that makes one."""
    if path.suffix.lower() == ".relaykv":
        return ArtifactError(f"{path}: truncated or not a .relaykv artifact ({why}); recompile it from its system "
                             f"prompt: relay compile-prompt SYS_TXT --out {path}")
    return ArtifactError(f"{path}: not a .relaykv artifact ({why}); if it is a system prompt, compile it first "
                         f"(relay compile-prompt {path}) and use {path.with_suffix('.relaykv')}")


def _short(x) -> str:
    return clipped(json.dumps(x))


def _wrong(path: Path, meta: dict, key: str, expected: str) -> ArtifactError:
    if key not in meta:
        return _bad(path, f"metadata field {key} is missing")
    return _bad(path, f"metadata field {key} is {_short(meta[key])}, not {expected}")


def _check_meta(path: Path, meta: dict) -> None:
    """Every field that loading, check_artifact, inspect and the engine read, by type and shape.

    Runs without the checksums too (inspect of a corrupt file), so nothing later can
    raise KeyError or TypeError on a hand-edited or damaged file."""
    for key in _STR_FIELDS:
        if not isinstance(meta.get(key), str):
            raise _wrong(path, meta, key, "a string")
    for key in _DIM_FIELDS:
        if not _is_int(meta.get(key)) or meta[key] < 1:
            raise _wrong(path, meta, key, "a positive integer")
    if not isinstance(meta.get("dtype"), str) or meta["dtype"] not in _BY_NAME:
        raise _wrong(path, meta, "dtype", "one of " + ", ".join(_BY_NAME))
    if not isinstance(meta.get("rope"), dict):
        raise _wrong(path, meta, "rope", "an object")
    ids = meta.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise _wrong(path, meta, "token_ids", "a non-empty list of token ids")
    if meta["format_version"] == LIBRARY_FORMAT_VERSION:
        problem = segment_problem(meta)
        if problem is not None:
            raise _bad(path, problem)
    else:
        segments = [system_segment(len(ids), False)]
        if meta.get("segments") != segments:
            raise _wrong(path, meta, "segments", f"{json.dumps(segments)}, the one segment of format {FORMAT_VERSION}")
    if "meta_checksum" in meta and not isinstance(meta["meta_checksum"], str):
        raise _wrong(path, meta, "meta_checksum", "a string")


def _check_header(path: Path, header: dict, meta: dict) -> int:
    """The tensor entries against the metadata; returns the bytes of one tensor, whose
    offsets are then known from the write order alone.

    The offsets must follow the write order exactly: the tensor checksum covers the data
    section as one run of bytes, so swapped offsets (K read as V) would still match it."""
    layers = meta["num_layers"]
    # Count first: a damaged num_layers of 10**9 must not build 2e9 names.
    if len(header) != 2 * layers or sorted(header) != sorted(names := _tensor_order(layers)):
        raise ArtifactError(f"{path}: tensor list does not match its metadata (metadata field num_layers is "
                            f"{layers}, the header has {len(header)} tensors); recompile it")
    shape = [num_rows(meta), meta["num_kv_heads"], meta["head_dim"]]
    dtype = _BY_NAME[meta["dtype"]]
    st_dtype = _ST_DTYPES[dtype]
    nbytes = shape[0] * shape[1] * shape[2] * torch.empty((), dtype=dtype).element_size()
    offset = 0
    for name in names:
        info = header[name]
        if not isinstance(info, dict):
            raise _bad(path, f"header entry {name} is {_short(info)}, not an object")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in info:
                raise _bad(path, f"header entry {name} has no {key}")
        if info["dtype"] != st_dtype:
            raise _bad(path, f"tensor {name} has dtype {_short(info['dtype'])}, the metadata says "
                             f"{meta['dtype']} ({st_dtype})")
        if info["shape"] != shape:
            raise _bad(path, f"tensor {name} has shape {_short(info['shape'])}, the metadata says {shape} "
                             "(num_tokens, num_kv_heads, head_dim)")
        if info["data_offsets"] != [offset, offset + nbytes]:
            raise _bad(path, f"tensor {name} has data_offsets {_short(info['data_offsets'])}, expected "
                             f"{[offset, offset + nbytes]} ({nbytes} bytes, in layer order)")
        offset += nbytes
    return nbytes


# Tensor checksums this process verified, by the file's identity and stat: a file read
# again unchanged (a library caller, a test, a worker loading it per job) is not re-hashed.
# A file changed within _RACY_NS before its check is not remembered: file times are
# coarser than the clock, so a write just after the check could leave its stat unchanged.
_verified: dict[tuple, str] = {}
_RACY_NS = 2_000_000_000


def _tensor_digest(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def read_artifact(path: Path, verify_checksum: bool = True) -> Artifact:
    """Memory-map and parse; refuse anything truncated, corrupt or of another format.

    The structure is checked with or without verify_checksum; the checksums, when
    verified, vouch for the content (the tensor checksum once a process for an unchanged
    file). The tensors are views of a read-only map of the file: nothing is copied here."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such artifact; make one with `relay compile-prompt`")
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())  # of the file mapped, even if the path is replaced meanwhile
            size = st.st_size
            if size < 8:
                raise _not_artifact(path, f"only {size} bytes")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read it ({exc.strerror}); check its permissions") from None
    (head_len,) = struct.unpack("<Q", mm[:8])
    if head_len > size - 8:
        raise _not_artifact(path, "its header runs past the end of the file")
    try:
        header = json.loads(bytes(mm[8:8 + head_len]))
        raw_meta = header.pop("__metadata__")[META_KEY]
        meta = json.loads(raw_meta)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise _not_artifact(path, "no relay metadata") from None
    if not isinstance(meta, dict):
        raise _bad(path, f"the relay metadata is {_short(meta)}, not a JSON object")
    if "format_version" not in meta:
        raise _bad(path, "metadata field format_version is missing")
    version = meta["format_version"]
    if version not in FORMAT_VERSIONS or not _is_int(version):
        raise ArtifactError(f"{path}: artifact format {_short(version)} is not a format this relay reads "
                            f"({', '.join(map(str, FORMAT_VERSIONS))}); recompile it with this relay version")
    _check_meta(path, meta)
    nbytes = _check_header(path, header, meta)
    names = _tensor_order(meta["num_layers"])
    base, end = 8 + head_len, nbytes * len(names)
    if base + end != size:
        raise ArtifactError(f"{path}: size {size} bytes, expected {base + end}: truncated or padded; recompile it")
    if verify_checksum:
        if "meta_checksum" not in meta:
            raise ChecksumError(f"{path}: no metadata checksum (made by an older relay), its metadata cannot be "
                                "verified; recompile it")
        if _meta_digest(meta) != meta["meta_checksum"]:
            raise ChecksumError(f"{path}: metadata checksum mismatch, the file is corrupt; recompile it")
        key = (str(path.resolve()), st.st_dev, st.st_ino, size, st.st_mtime_ns, st.st_ctime_ns)
        if _verified.get(key) != meta["checksum"]:
            started = time.time_ns()
            if "sha256:" + _tensor_digest(memoryview(mm)[base:base + end]) != meta["checksum"]:
                raise ChecksumError(f"{path}: checksum mismatch, the file is corrupt; recompile it")
            if max(st.st_mtime_ns, st.st_ctime_ns) < started - _RACY_NS:
                _verified[key] = meta["checksum"]
    dtype = _BY_NAME[meta["dtype"]]
    shape = (num_rows(meta), meta["num_kv_heads"], meta["head_dim"])
    count = shape[0] * shape[1] * shape[2]
    tensors = {}
    for i, name in enumerate(names):
        with warnings.catch_warnings():  # read-only map: the tensors are never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + i * nbytes)
        tensors[name] = flat.view(shape)
    keys = [tensors[f"layers.{i}.k"] for i in range(meta["num_layers"])]
    values = [tensors[f"layers.{i}.v"] for i in range(meta["num_layers"])]
    return Artifact(path, meta, keys, values)


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]

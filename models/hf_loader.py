"""Hugging Face model directories: config.json, *.safetensors (sharded too), tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from relaycli.models.config import ModelConfig, ModelConfigError


def hf_config(path: Path) -> ModelConfig:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelConfigError(f"{path}: no config.json; a model directory needs config.json, "
                               "*.safetensors and tokenizer files")
    try:
        raw = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise ModelConfigError(f"{cfg_path}: not valid JSON ({exc})") from None
    gen_path = path / "generation_config.json"
    config = ModelConfig.from_hf_dict(raw)
    if gen_path.is_file():
        try:
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except ValueError:
            eos = None
        if eos is not None:
            extra = [eos] if isinstance(eos, int) else list(eos)
            config.eos_token_ids = sorted(set(config.eos_token_ids) | {int(e) for e in extra})
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a directory, through the shard index when there is one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelConfigError(f"{index}: malformed shard index ({exc})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelConfigError(f"{path}: shard files named in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{path}: no *.safetensors weight files (pickled .bin weights are not loaded)")
    return files


def hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

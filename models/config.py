"""Model configuration: the one dataclass every Llama-family model is described by."""

from __future__ import annotations

from relaycli.errors import RelayError
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# HF `architectures` names this code can run, and what each switches on.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class ModelConfigError(RelayError):
    """A config that this code cannot honour; the message says what."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or the HF dict for `rope_type: llama3` (factor, low/high_freq_factor,
    # original_max_position_embeddings).
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when `attention_bias`
    o_bias: bool = False  # Llama/Qwen3 when `attention_bias`; never Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unknown architecture {self.architecture!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type in (None, "default"):
                self.rope_scaling = None
            elif rope_type != "llama3":
                raise ModelConfigError(
                    f"model config: rope_scaling type {rope_type!r} is not supported (only 'llama3')"
                )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def rope_settings(self) -> dict[str, Any]:
        """What the keys stored after RoPE depend on; an artifact records and checks it."""
        return {"rope_theta": float(self.rope_theta), "head_dim": self.head_dim,
                "rope_scaling": self.rope_scaling}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs:
            raise ModelConfigError("config.json has no 'architectures' entry; cannot tell the model type")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unknown architecture {arch!r}; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or hidden // num_heads
            # transformers 5 moved rope settings under `rope_parameters`.
            rope_params = cfg.get("rope_parameters") or {}
            rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
            rope_scaling = cfg.get("rope_scaling")
            if rope_scaling is None and rope_params.get("rope_type") not in (None, "default"):
                rope_scaling = rope_params
            if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
                window = int(cfg["sliding_window"])
                max_pos = int(cfg.get("max_position_embeddings", window))
                if window < max_pos:
                    raise ModelConfigError(
                        f"model config: sliding_window={window} is smaller than the context "
                        f"({max_pos}); sliding-window attention is not supported"
                    )
            if cfg.get("mlp_bias"):
                raise ModelConfigError("model config: mlp_bias=true is not supported")
            eos = cfg.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json is missing the field {exc.args[0]!r}") from None

"""compile-prompt: system text -> shared prefix tokens -> per-layer KV -> .relaykv;
and the checks that an artifact fits the model of a run."""

from __future__ import annotations

from relaycli.errors import RelayError
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from relaycli.kernels import cpu_flash
from relaycli.kernels.backend import default_impl
from relaycli.kernels.reference import attention_lse
from relaycli.models.registry import LoadedModel
from relaycli.artifact import Artifact, ArtifactError, dtype_name, read_artifact, save_artifact

# Different user turns: their renderings share exactly the system part and the
# template's lead-in to a user turn, whatever the first user token is. Leading
# whitespace probes matter: BPE merges "\n" + "\n\n" across the turn boundary, so
# the prefix must stop before any token that a user's first characters can change.
_PROBE_MESSAGES = ("Hi", "What is 2 + 2?", "¿Dónde está la biblioteca?\n\nGracias.", "x", "1",
                   "\n\nx", " x", "\tx", "\r\nx", "  \n")


class CompileError(RelayError):
    pass


@dataclass
class CompileResult:
    path: Path
    num_tokens: int
    num_bytes: int
    seconds: float


def read_system_text(path: Path) -> str:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CompileError(f"{path}: no such file; give the system prompt as a UTF-8 text file") from None
    except OSError as exc:
        raise CompileError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CompileError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    # The request reader drops a BOM too: kept here, the artifact's prefix would start with
    # three tokens no request has, and no row would hit it.
    text = text.removeprefix("\ufeff").strip()
    if not text:
        raise CompileError(f"{path}: the system prompt is empty; write the prompt into the file")
    return text


def shared_prefix_ids(tokenizer, system_text: str) -> list[int]:
    """The exact tokens every rendered request with this system text starts with."""
    renders = []
    for user in _PROBE_MESSAGES:
        try:
            renders.append(tokenizer.render([{"role": "system", "content": system_text},
                                             {"role": "user", "content": user}]))
        except Exception as exc:  # jinja raises its own types for templates without a system role
            raise CompileError(f"the chat template of {tokenizer.source} does not take a system turn ({exc})") from None
    common = renders[0]
    for ids in renders[1:]:
        n = 0
        while n < min(len(common), len(ids)) and common[n] == ids[n]:
            n += 1
        common = common[:n]
    if not common:
        raise CompileError("the rendered requests share no token prefix; this chat template cannot use a compiled prompt")
    return common


@torch.inference_mode()
def prefill_kv(loaded: LoadedModel, token_ids: list[int], chunk_size: int = 512,
               progress: Callable[[int, int], None] | None = None,
               context: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
               first_position: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K (post-RoPE) and V [S, Hkv, D] of the prompt at positions 0..S-1.

    context: per-layer K and V [C, Hkv, D] that every token also attends to (a prompt
    module's system prompt and parent chain); first_position: the first token's position.
    Only the new tokens' K and V are returned."""
    model, cfg = loaded.model, loaded.config
    ctx = 0 if context is None else context[0][0].shape[0]
    num = len(token_ids)
    shape = (ctx + num, cfg.num_key_value_heads, cfg.head_dim)
    keys = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in range(cfg.num_hidden_layers)]
    values = [torch.empty_like(k) for k in keys]
    if context is not None:
        for layer in range(cfg.num_hidden_layers):
            keys[layer][:ctx] = context[0][layer]
            values[layer][:ctx] = context[1][layer]
    scale = cfg.head_dim ** -0.5
    attend_lse = cpu_flash.fused_attention_lse if default_impl(model.device) == "cpu-flash" else attention_lse
    ids = torch.tensor(token_ids, dtype=torch.int64, device=model.device)
    for start in range(0, num, chunk_size):
        end = min(start + chunk_size, num)
        mask = (torch.arange(ctx + end, device=model.device)[None, :]
                <= torch.arange(ctx + start, ctx + end, device=model.device)[:, None])[None]

        def attend(layer, q, k, v, lo=ctx + start, hi=ctx + end, mask=mask):
            keys[layer][lo:hi] = k
            values[layer][lo:hi] = v
            o, _ = attend_lse(q[None], keys[layer][None, :hi], values[layer][None, :hi], scale, mask)
            return o[0]

        model(ids[start:end], torch.arange(first_position + start, first_position + end, device=model.device), attend)
        if progress is not None:
            progress(end, num)
    if context is not None:
        return [k[ctx:] for k in keys], [v[ctx:] for v in values]
    return keys, values


@dataclass
class TokenPrefix:
    """A shared prefix given as token ids and prefilled in memory (benchmarks, dummy models
    without a tokenizer). Engine takes it as it takes a loaded artifact."""

    name: str
    token_ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    system_text: str = ""


def prefix_from_ids(loaded: LoadedModel, token_ids: list[int], name: str = "prefix") -> TokenPrefix:
    return TokenPrefix(name, list(token_ids), *prefill_kv(loaded, token_ids))


def artifact_meta(loaded: LoadedModel, system_text: str, token_ids: list[int]) -> dict:
    cfg, tok = loaded.config, loaded.tokenizer
    return {
        "model_reference": loaded.reference,
        "model_fingerprint": loaded.fingerprint,
        "tokenizer_fingerprint": tok.fingerprint(),
        "chat_template_fingerprint": tok.template_fingerprint(),
        "dtype": dtype_name(loaded.model.dtype),
        "rope": cfg.rope_settings(),
        "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "token_ids": token_ids,
        "system_text": system_text,
        "created_unix": int(time.time()),
    }


def compile_prompt(loaded: LoadedModel, system_text: str, out: Path,
                   progress: Callable[[int, int], None] | None = None) -> CompileResult:
    if loaded.tokenizer is None:
        raise CompileError(f"{loaded.reference} has no tokenizer (dummy weights); compile with a real model")
    start = time.perf_counter()
    ids = shared_prefix_ids(loaded.tokenizer, system_text)
    limit = loaded.config.max_position_embeddings
    if len(ids) >= limit:
        raise CompileError(f"the system prompt is {len(ids)} tokens, the model's context is {limit}; shorten it")
    keys, values = prefill_kv(loaded, ids, progress=progress)
    nbytes = save_artifact(out, keys, values, artifact_meta(loaded, system_text, ids))
    return CompileResult(Path(out), len(ids), nbytes, time.perf_counter() - start)


def check_artifact(art: Artifact, loaded: LoadedModel, allow_cast: bool = False) -> Artifact:
    """Refuse an artifact made for another model, tokenizer, template, RoPE or dtype.

    With allow_cast, a dtype mismatch is converted (the caller says so to the user)."""
    meta, name = art.meta, art.path.name
    if meta["model_fingerprint"] != loaded.fingerprint:
        raise ArtifactError(f"{name} was compiled for model {meta['model_reference']} "
                            f"(fingerprint {meta['model_fingerprint'][:12]}), but this run uses {loaded.reference} "
                            f"({loaded.fingerprint[:12]}); recompile it with this model")
    tok = loaded.tokenizer
    if tok is not None and meta["tokenizer_fingerprint"] != tok.fingerprint():
        raise ArtifactError(f"{name} was compiled with tokenizer {meta['tokenizer_fingerprint'][:12]}, this run's "
                            f"tokenizer is {tok.fingerprint()[:12]}; recompile it")
    if tok is not None and meta["chat_template_fingerprint"] != tok.template_fingerprint():
        raise ArtifactError(f"{name} was compiled with chat template {meta['chat_template_fingerprint'][:12]}, this "
                            f"run's template is {tok.template_fingerprint()[:12]}; recompile it")
    rope = loaded.config.rope_settings()
    if meta["rope"] != rope:
        raise ArtifactError(f"{name} has RoPE settings {meta['rope']}, the model has {rope}; recompile it")
    want = dtype_name(loaded.model.dtype)
    if meta["dtype"] != want:
        if not allow_cast:
            raise ArtifactError(f"{name} holds {meta['dtype']} KV, this run computes in {want}; recompile it with "
                                f"--dtype {want} or pass --allow-cast")
        art = Artifact(art.path, art.meta, [k.to(loaded.model.dtype) for k in art.keys],
                       [v.to(loaded.model.dtype) for v in art.values])
    return art


def load_checked(path: Path, loaded: LoadedModel, allow_cast: bool = False) -> Artifact:
    return check_artifact(read_artifact(path), loaded, allow_cast)

"""Tokenizer and chat template, through transformers so rendering matches it exactly."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    pass


class ChatTokenizer:
    """A transformers tokenizer plus what relay needs of it: chat rendering to ids,
    decoding, end-of-sequence ids, and fingerprints that artifacts record."""

    def __init__(self, hf_tokenizer: Any, source: str, extra_eos_ids: list[int] | None = None) -> None:
        self.hf = hf_tokenizer
        self.source = source
        eos = set(extra_eos_ids or [])
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_dir(cls, path: Path, extra_eos_ids: list[int] | None = None) -> "ChatTokenizer":
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # transformers raises many types here
            raise TokenizerError(f"{path}: cannot load the tokenizer ({exc})") from None
        return cls(tok, str(path), extra_eos_ids)

    @classmethod
    def from_gguf(cls, path: Path, extra_eos_ids: list[int] | None = None) -> "ChatTokenizer":
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as exc:
            raise TokenizerError(f"{path}: cannot build a tokenizer from the GGUF metadata ({exc})") from None
        return cls(tok, str(path), extra_eos_ids)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat, exactly as transformers' apply_chat_template gives them."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: the tokenizer has no chat template; relay needs one "
                                 "to render system and user turns")
        out = self.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                          return_dict=True)
        return list(out["input_ids"])

    def render_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def fingerprint(self) -> str:
        backend = getattr(self.hf, "backend_tokenizer", None)
        body = backend.to_str() if backend is not None else repr(sorted(self.hf.get_vocab().items()))
        return hashlib.sha256(body.encode()).hexdigest()

    def template_fingerprint(self) -> str:
        return hashlib.sha256((self.chat_template or "").encode()).hexdigest()

    def save(self, path: Path) -> None:
        self.hf.save_pretrained(str(path))

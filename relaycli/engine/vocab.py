"""The bytes each token id stands for, from a tokenizer's raw vocabulary. Torch-free.

Logprobs report each token's text and bytes (a token can hold part of a UTF-8
character), and the grammar matcher needs the vocabulary in the form its decoder reads:
- byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen): each byte is written as one printable
  character: the printable Latin-1 bytes as themselves, the other 68 bytes as the
  characters from U+0100 on, in byte order;
- byte fallback (Llama 2, Mistral): `<0xAB>` is one byte, and U+2581 stands for a space;
- anything else: the token's text as UTF-8.
"""

from __future__ import annotations

import json
import re
from functools import cached_property

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"


def _byte_level_alphabet() -> dict[str, int]:
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in alphabet.values():
            alphabet[chr(0x100 + shifted)] = b
            shifted += 1
    return alphabet


def _decoder_kinds(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    kinds = {decoder.get("type")}
    for part in decoder.get("decoders") or []:
        kinds |= _decoder_kinds(part)
    return kinds


class Vocab:
    """Raw token strings and their bytes for ids 0..size-1 (size: the model's logits
    width; ids past the tokenizer's vocabulary have no text)."""

    def __init__(self, tokenizer, size: int) -> None:
        backend = tokenizer.backend
        kinds = _decoder_kinds(json.loads(backend.to_str()).get("decoder"))
        self.kind = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else "raw"
        self.size = size
        self.raw = [backend.id_to_token(i) or "" for i in range(size)]

    @cached_property
    def _alphabet(self) -> dict[str, int]:
        return _byte_level_alphabet()

    def token_bytes(self, token_id: int) -> bytes:
        raw = self.raw[token_id] if 0 <= token_id < self.size else ""
        if self.kind == "byte_level":
            alphabet = self._alphabet
            if all(ch in alphabet for ch in raw):
                return bytes(alphabet[ch] for ch in raw)
            return raw.encode("utf-8")  # an added token written as plain text
        if self.kind == "byte_fallback":
            m = _BYTE_TOKEN.fullmatch(raw)
            if m:
                return bytes([int(m.group(1), 16)])
            return raw.replace(_SPACE_MARK, " ").encode("utf-8")
        return raw.encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """The token's bytes as text; a byte that is part of a character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

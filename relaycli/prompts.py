"""From a request row to prompt token ids and the loaded prefix it starts with.

A row picks a loaded artifact by `system_prompt` (the artifact's name) or by its own
system message (the same text as an artifact's); a row with neither uses the first
loaded artifact. A row whose own system message matches no artifact is answered by
a full prefill and counted as a prefix miss; so is a row whose rendered ids do not
start with the artifact's tokens (a template that merges across the boundary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


class PromptSource(Protocol):
    name: str
    system_text: str
    token_ids: list[int]


@dataclass
class PreparedPrompt:
    prompt_ids: list[int]
    prefix_slot: int | None  # index into the loaded artifacts
    num_prefix_tokens: int
    is_prefix_miss: bool


class PromptError(ValueError):
    """A row that cannot be rendered; the message names the fix."""


class PromptMatcher:
    def __init__(self, tokenizer, artifacts: Sequence[PromptSource]) -> None:
        self.tokenizer = tokenizer
        self.artifacts = list(artifacts)
        self._by_name = {a.name: i for i, a in enumerate(self.artifacts)}
        self._by_text = {}
        for i, a in enumerate(self.artifacts):
            self._by_text.setdefault(a.system_text, i)

    def prepare(self, messages: list[dict[str, str]], system_prompt: str | None) -> PreparedPrompt:
        has_system = bool(messages) and messages[0].get("role") == "system"
        slot: int | None = None
        miss = False
        if system_prompt is not None:
            if system_prompt not in self._by_name:
                loaded = ", ".join(self._by_name) or "none"
                raise PromptError(f"system_prompt {system_prompt!r} names no loaded artifact (loaded: {loaded}); "
                                  "pass it with --prompt or fix the name")
            if has_system:
                raise PromptError("the row has both system_prompt and a system message; give one of them")
            slot = self._by_name[system_prompt]
        elif has_system:
            slot = self._by_text.get(messages[0].get("content", ""))
            miss = slot is None and bool(self.artifacts)
        elif self.artifacts:
            slot = 0
        if slot is not None and not has_system:
            messages = [{"role": "system", "content": self.artifacts[slot].system_text}] + list(messages)
        ids = self.tokenizer.render(messages)
        if slot is None:
            return PreparedPrompt(ids, None, 0, miss)
        prefix = self.artifacts[slot].token_ids
        if len(ids) <= len(prefix) or ids[:len(prefix)] != prefix:
            return PreparedPrompt(ids, None, 0, True)
        return PreparedPrompt(ids, slot, len(prefix), False)

"""From a request row to prompt token ids and the loaded prefix it starts with.

A row picks a loaded artifact by `system_prompt` (the artifact's name) or by its own
system message (the same text as an artifact's); a row with neither uses the first
loaded artifact. A row whose own system message matches no artifact is answered by
a full prefill and counted as a prefix miss; so is a row whose rendered ids do not
start with the artifact's tokens (a template that merges across the boundary).

Every row's chat is rendered to text whole, but a row that uses an artifact is not
tokenized whole: HF `tokenizers` first cuts the text at added tokens (special tokens),
then normalizes, pre-tokenizes and models each piece on its own. So when the rendered
text starts with the artifact's anchor, text that ends right after an added token, its
ids are the artifact's ids of the anchor followed by the ids of the rest. The rest is
encoded behind a copy of that token, which it then drops: the piece after the cut sits
at a nonzero offset as it does in the whole text (a Metaspace pre-tokenizer prepends
only at offset 0). A row that cannot be shown to cut cleanly there, and every row of
an artifact whose probes disagree with whole tokenization, is tokenized whole: the same
ids, more work, flagged in `PreparedPrompt.full_render`.
"""

from __future__ import annotations

from relaycli.errors import RelayError
import os
from dataclasses import dataclass
from typing import Protocol, Sequence


class PromptSource(Protocol):
    name: str
    system_text: str
    token_ids: list[int]


@dataclass
class PreparedPrompt:
    """A row's prompt: the loaded prefix it starts with (its ids are the artifact's, not
    copied here) and its own ids after it; without a prefix, own_ids are all of them."""

    own_ids: list[int]
    prefix_slot: int | None  # index into the loaded artifacts
    num_prefix_tokens: int
    is_prefix_miss: bool
    # The row picked an artifact, yet its ids come from tokenizing the whole rendered chat
    # (the cut at the anchor could not be proven exact for this row or this artifact).
    full_render: bool = False
    prefix_ids: Sequence[int] = ()  # the artifact's token ids (a reference)

    @property
    def prompt_ids(self) -> list[int]:
        """Every id of the prompt (a copy of the prefix's: for checks, not the hot path)."""
        return list(self.prefix_ids) + self.own_ids


class PromptError(RelayError):
    """A row that cannot be rendered; the message names the fix."""


@dataclass(frozen=True)
class Splice:
    """Where one artifact's rows are cut: `anchor` is text every such row starts with,
    ending right after the added token `token`; `head_ids` are its ids.

    Encoding the rest behind `token` also gives it the same left neighbour as in the whole
    text, so a token that strips whitespace on its right, or a single-word token right
    after the cut, behaves alike in both; whitespace stripped on the left never reaches
    past the previous match. `token` itself is never single-word or normalized."""

    anchor: str
    head_ids: list[int]
    token: str
    token_id: int
    # Starts of the rest that would let an added token straddle the cut (a token that
    # begins inside the anchor's end and continues into the row).
    guards: tuple[str, ...]

    def rest_ids(self, tokenizer, text: str) -> list[int] | None:
        """The ids of the whole text after head_ids, or None when this text cannot be cut here."""
        if not text.startswith(self.anchor):
            return None
        rest = text[len(self.anchor):]
        if rest.startswith(self.guards):
            return None
        tail = tokenizer.encode(self.token + rest)
        if not tail or tail[0] != self.token_id:
            return None
        return tail[1:]

    def ids(self, tokenizer, text: str) -> list[int] | None:
        """The ids of the whole text, or None when this text cannot be cut here."""
        rest = self.rest_ids(tokenizer, text)
        return None if rest is None else self.head_ids + rest


class PromptMatcher:
    def __init__(self, tokenizer, artifacts: Sequence[PromptSource]) -> None:
        self.tokenizer = tokenizer
        self.artifacts = list(artifacts)
        self._by_name = {a.name: i for i, a in enumerate(self.artifacts)}
        self._by_text = {}
        for i, a in enumerate(self.artifacts):
            self._by_text.setdefault(a.system_text, i)
        self.splices: list[Splice | None] = [plan_splice(tokenizer, a.system_text, a.token_ids)
                                             for a in self.artifacts]

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
        text = self.tokenizer.render_text(messages)
        splice = self.splices[slot] if slot is not None else None
        rest = splice.rest_ids(self.tokenizer, text) if splice is not None else None
        if slot is None:
            return PreparedPrompt(self.tokenizer.encode(text), None, 0, miss)
        prefix = self.artifacts[slot].token_ids
        n = len(prefix)
        if rest is not None:  # ids = head_ids + rest, and head_ids are the prefix's first ids
            k = len(splice.head_ids)
            if len(rest) > n - k and rest[:n - k] == prefix[k:n]:
                return PreparedPrompt(rest[n - k:], slot, n, False, False, prefix)
            return PreparedPrompt(splice.head_ids + rest, None, 0, True, False)
        ids = self.tokenizer.encode(text)
        if len(ids) <= n or ids[:n] != prefix:
            return PreparedPrompt(ids, None, 0, True, True)
        return PreparedPrompt(ids[n:], slot, n, False, True, prefix)


# ---- finding and proving the cut for one artifact ---------------------------------------

# Row shapes whose renderings share the anchor: different first turns and roles.
_ANCHOR_CHATS = ([("user", "Hi")], [("user", "\n\n1 + 1?")], [("user", " x")],
                 [("assistant", "Hello."), ("user", "x")])

# Rows that try to make the cut differ from whole tokenization: whitespace at both ends,
# text that merges with its neighbours, unicode, empty-looking text, special-token strings
# (added per tokenizer), multi-turn chats.
_PROBE_TEXTS = ("x", " leading", "\n\nx", "x\n\n", " ", "\t\ttab\r\n", "\u00a0\u3000nbsp",
                "e\u0301\u00e9🙂👍🏽中文مرحبا", "\u200bzero\u200d", "<|", "|>")


def plan_splice(tokenizer, system_text: str, token_ids: list[int]) -> Splice | None:
    """The cut for rows with this system text, proven on adversarial probes; None when
    there is none (every row of the artifact is then tokenized whole)."""
    try:
        splice = _find_splice(tokenizer, system_text, list(token_ids))
        if splice is None:
            return None
        texts, spliced = [], []
        for chat in _probe_chats(tokenizer, system_text, splice):
            try:
                text = tokenizer.render_text(chat)
            except Exception:  # noqa: BLE001 - a template may refuse a probe shape; rows of that shape fail alike
                continue
            got = splice.ids(tokenizer, text)
            if got is not None:
                texts.append(text)
                spliced.append(got)
        # the whole texts are the long part (each holds the system text): encoded in parallel
        if any(got != whole for got, whole in zip(spliced, tokenizer.encode_batch(texts))):
            return None
        return splice
    except Exception:  # noqa: BLE001 - no cut is always correct: the rows are tokenized whole
        return None


def _find_splice(tokenizer, system_text: str, token_ids: list[int]) -> Splice | None:
    texts = []
    for turns in _ANCHOR_CHATS:
        try:
            texts.append(tokenizer.render_text(_chat(system_text, turns)))
        except Exception:  # noqa: BLE001 - a template may refuse a row shape; the others still find the anchor
            continue
    if len(texts) < 2 or not token_ids:
        return None
    common = os.path.commonprefix(texts)
    added = tokenizer.added_tokens()
    # Tokens that are cut out of the raw text as themselves wherever they occur.
    cuts = {t.content: t.id for t in added if t.splits and t.content and not t.normalized and not t.single_word}
    ends = sorted({common.rfind(c) + len(c) for c in cuts if common.rfind(c) >= 0}, reverse=True)
    for end in ends[:3]:
        anchor = common[:end]
        token = next(c for c in sorted(cuts, key=len, reverse=True) if anchor.endswith(c))
        if system_text.strip() not in anchor:  # a cut before the system text saves nothing
            break
        ids, offsets = tokenizer.encode_with_offsets(anchor)
        if (not ids or ids[-1] != cuts[token] or offsets[-1][1] != end or offsets[-1][0] > end - len(token)
                or len(ids) > len(token_ids) or ids != token_ids[:len(ids)]):
            continue
        guards = {t.content[j:] for t in added for j in range(1, len(t.content)) if anchor.endswith(t.content[:j])}
        return Splice(anchor, ids, token, cuts[token], tuple(sorted(guards)))
    return None


def _chat(system_text: str, turns) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_text}] + [{"role": r, "content": c} for r, c in turns]


def _probe_chats(tokenizer, system_text: str, splice: Splice):
    contents = sorted({t.content for t in tokenizer.added_tokens() if t.content}, key=len)
    near = splice.anchor[:200] + splice.anchor[-200:]
    specials = [c for c in contents if c in near][:6] + [c for c in contents if c not in near][:2]
    cut = splice.token
    texts = [*_PROBE_TEXTS, *specials, cut[1:], cut[:-1], cut * 2 + "x", system_text, splice.anchor[-40:],
             *(g + " x" for g in splice.guards[:4])]
    for text in texts:
        yield _chat(system_text, [("user", text)])
    yield _chat(system_text, [("user", "Hi"), ("assistant", f"Hello {cut}\n"), ("user", " \n again \n")])
    yield _chat(system_text, [("assistant", " \nfirst"), ("user", specials[-1] if specials else "x")])
    yield _chat(system_text, [("user", "a"), ("assistant", ""), ("user", "\n")])

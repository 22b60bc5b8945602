"""PromptMatcher cuts a row's ids at its artifact's anchor instead of tokenizing the whole
chat: over hundreds of seeded adversarial rows the ids equal whole rendering, exactly, for
ChatML (the default model), a Llama 3 template, chat tokens that strip whitespace, a
Metaspace tokenizer and an added token that straddles the cut."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from relaycli.models.tokenizer import ChatTokenizer
from relaycli.compile import shared_prefix_ids
from relaycli.prompts import PromptError, PromptMatcher, plan_splice
from tests import helpers_tokenizers as H

ROWS = 300
WORDS = ("the", "invoice", "Refund", "plan", "café", "naïve", "中文", "مرحبا", "🙂", "👍🏽", "e\u0301", "x", "42",
         "Tidemark", "don't", "((", "))", "{{", "}}", "{%", "->", "...", "?!", "\\n")
SPACES = (" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "\u200b", " \n ", "\n\n\n")
LONG_SYSTEM = ("You are Quill, the support assistant of Larkspur Software. Answer in at most three sentences, "
               "quote the plan name exactly, and never promise refunds.\n\nRules:\n- Be kind.\n- Be brief.\n") * 6
ODD_SYSTEM = "  Réponds en français 🙂\n\n<|im_end|> is text here; so is <|eot_id|>.\t"


@dataclass
class Art:
    name: str
    system_text: str
    token_ids: list[int]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("toks")
    smol = H.default_tokenizer_dir(tmp)
    return {"chatml": smol, "llama3": H.llama3_dir(smol, tmp / "llama3"),
            "stripping": H.stripping_dir(smol, tmp / "stripping"),
            "metaspace": H.metaspace_dir(tmp / "metaspace"),
            "straddling": H.straddling_dir(smol, tmp / "straddling")}


def _text(rng: random.Random, specials: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        if kind < 0.5:
            parts.append(rng.choice(WORDS))
        elif kind < 0.75:
            parts.append(rng.choice(SPACES))
        elif kind < 0.9:
            parts.append(rng.choice(specials))
        else:
            parts.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 4))))
        parts.append(rng.choice(("", " ")))
    text = rng.choice(("", " ", "\n", "\n\n", "\t")) + "".join(parts) + rng.choice(("", " ", "\n", "\n\n"))
    return text if text.strip() else text + "x"


def _row(rng: random.Random, arts: list[Art], specials: list[str]):
    """(messages, system_prompt, the full chat, the artifact the row uses or None, assistant first)."""
    turns = []
    assistant_first = rng.random() < 0.15
    roles = (["assistant"] if assistant_first else []) + ["user", "assistant"] * rng.randint(0, 2) + ["user"]
    for role in roles:
        turns.append({"role": role, "content": _text(rng, specials)})
    art = rng.choice(arts)
    how = rng.random()
    if how < 0.3:  # its own system message, the artifact's text
        return [{"role": "system", "content": art.system_text}] + turns, None, art, assistant_first
    if how < 0.55:  # names the artifact
        return turns, art.name, art, assistant_first
    if how < 0.9:  # neither: the first artifact
        return turns, None, arts[0], assistant_first
    own = [{"role": "system", "content": art.system_text + " "}]  # a system text no artifact has
    return own + turns, None, None, assistant_first


@pytest.mark.parametrize("name", ["chatml", "llama3", "stripping", "metaspace", "straddling"])
def test_spliced_ids_equal_whole_rendering(dirs, name):
    tok = ChatTokenizer.from_dir(dirs[name])
    arts = [Art(n, t, shared_prefix_ids(tok, t)) for n, t in (("long", LONG_SYSTEM), ("odd", ODD_SYSTEM))]
    matcher = PromptMatcher(tok, arts)
    assert all(s is not None for s in matcher.splices), "no provable cut for an ordinary template"
    specials = sorted({t.content for t in tok.added_tokens()}, key=len)[:10] + ["<|", "|>", "im_start", "<|eot"]
    rng = random.Random(f"splice-{name}")
    fallbacks = spliced = 0
    for _ in range(ROWS):
        messages, named, art, assistant_first = _row(rng, arts, specials)
        full = messages if art is None or messages[0]["role"] == "system" else \
            [{"role": "system", "content": art.system_text}] + messages
        want = tok.render(full)
        got = matcher.prepare(messages, named)
        assert got.prompt_ids == want, (name, messages)
        if art is None:
            assert got.is_prefix_miss and got.prefix_slot is None and not got.full_render
            continue
        n = len(art.token_ids)
        if want[:n] == art.token_ids and len(want) > n:
            assert got.prefix_slot == arts.index(art) and got.num_prefix_tokens == n and not got.is_prefix_miss
        else:  # the first turn after the system is not the probes' user turn
            assert assistant_first and got.is_prefix_miss and got.prefix_slot is None
        if got.full_render:
            fallbacks += 1
            # Only an added token that could straddle the cut makes a row fall back.
            assert name == "straddling" and assistant_first, messages
        else:
            spliced += 1
    assert spliced > ROWS * 0.6
    if name == "straddling":
        assert 0 < fallbacks < ROWS * 0.25
    else:
        assert fallbacks == 0


def test_straddling_token_is_guarded(dirs):
    tok = ChatTokenizer.from_dir(dirs["straddling"])
    splice = plan_splice(tok, LONG_SYSTEM, shared_prefix_ids(tok, LONG_SYSTEM))
    assert splice.anchor.endswith("<|im_start|>") and "assistant" in splice.guards
    chat = [{"role": "system", "content": LONG_SYSTEM}, {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "x"}]
    text = tok.render_text(chat)
    assert splice.ids(tok, text) is None
    # Cut anyway, the ids would be wrong: "\n<|im_start|>assistant" is one token across the cut.
    unguarded = splice.head_ids + tok.encode(splice.token + text[len(splice.anchor):])[1:]
    whole = tok.render(chat)
    assert unguarded != whole and whole[len(splice.head_ids) - 2] == tok.token_id("\n<|im_start|>assistant")


class _LyingTokenizer:
    """The default tokenizer, except that text starting with a chat token loses its last id:
    a cut that disagrees with whole tokenization, which the probes must catch."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text):
        ids = self._tok.encode(text)
        return ids[:-1] if text.startswith("<|im_start|>") and len(text) < 200 else ids


def test_a_cut_the_probes_contradict_is_never_used(dirs):
    tok = ChatTokenizer.from_dir(dirs["chatml"])
    art = Art("long", LONG_SYSTEM, shared_prefix_ids(tok, LONG_SYSTEM))
    assert plan_splice(tok, art.system_text, art.token_ids) is not None
    liar = _LyingTokenizer(tok)
    matcher = PromptMatcher(liar, [art])
    assert matcher.splices == [None]
    got = matcher.prepare([{"role": "user", "content": "hello"}], None)
    assert got.full_render and got.prefix_slot == 0
    assert got.prompt_ids == tok.render([{"role": "system", "content": LONG_SYSTEM},
                                         {"role": "user", "content": "hello"}])


def test_an_artifact_without_a_cut_still_answers_exactly(dirs):
    tok = ChatTokenizer.from_dir(dirs["chatml"])
    # A token prefix that is no rendering of its text (a benchmark prefix): no cut, a prefix miss.
    ids_only = Art("ids", "", [1, 2, 3])
    matcher = PromptMatcher(tok, [ids_only])
    assert matcher.splices == [None]
    got = matcher.prepare([{"role": "user", "content": "hi"}], None)
    assert got.prompt_ids == tok.render([{"role": "system", "content": ""}, {"role": "user", "content": "hi"}])
    assert got.is_prefix_miss and got.prefix_slot is None and got.full_render


def test_a_template_without_a_token_after_the_system_text_tokenizes_rows_whole(dirs, tmp_path):
    # The system text opens the first turn's text: the last added token before a row's own
    # text comes before the system text, so a cut there would save nothing.
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "tokenizer.json").write_bytes((dirs["chatml"] / "tokenizer.json").read_bytes())
    (merged / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": (
        "{{ '<|im_start|>' }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content + '\\n\\n' }}"
        "{% else %}{{ m.role + ': ' + m.content + '<|im_end|>' }}{% endif %}{% endfor %}")}))
    tok = ChatTokenizer.from_dir(merged)
    art = Art("long", LONG_SYSTEM, shared_prefix_ids(tok, LONG_SYSTEM))
    matcher = PromptMatcher(tok, [art])
    assert matcher.splices == [None]
    rows = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": " <|im_end|>\n"}]]
    for row in rows:
        got = matcher.prepare(row, None)
        assert got.full_render and got.prefix_slot == 0
        assert got.prompt_ids == tok.render([{"role": "system", "content": LONG_SYSTEM}] + row)


def test_row_semantics_are_kept(dirs):
    tok = ChatTokenizer.from_dir(dirs["chatml"])
    arts = [Art(n, t, shared_prefix_ids(tok, t)) for n, t in (("a", "System A."), ("b", "System B."))]
    matcher = PromptMatcher(tok, arts)
    user = [{"role": "user", "content": "hi"}]
    assert matcher.prepare(user, None).prefix_slot == 0
    assert matcher.prepare(user, "b").prefix_slot == 1
    assert matcher.prepare([{"role": "system", "content": "System B."}] + user, None).prefix_slot == 1
    miss = matcher.prepare([{"role": "system", "content": "Other."}] + user, None)
    assert miss.is_prefix_miss and miss.prefix_slot is None and miss.num_prefix_tokens == 0
    with pytest.raises(PromptError, match="names no loaded artifact"):
        matcher.prepare(user, "c")
    with pytest.raises(PromptError, match="both system_prompt and a system message"):
        matcher.prepare([{"role": "system", "content": "System A."}] + user, "a")
    none = PromptMatcher(tok, []).prepare(user, None)
    assert none.prefix_slot is None and not none.is_prefix_miss and none.prompt_ids == tok.render(user)

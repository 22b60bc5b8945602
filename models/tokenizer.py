"""Tokenizer and chat template: HF `tokenizers` for ids and jinja2 for chat rendering.

Rendering and tokenization reproduce transformers' `apply_chat_template` and `decode`
(its sandboxed Jinja environment, globals and filters; the rendered text tokenized without
added special tokens) without importing transformers, which costs seconds of every start.
Only `from_gguf` uses transformers, once, to convert a GGUF file's tokenizer metadata.
"""

from __future__ import annotations

from relaycli.errors import RelayError
import hashlib
import json
from collections import namedtuple
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, processors

# The named special tokens of transformers' tokenizers; with the model's own `*_token`
# entries they are the template variables `bos_token`, `eos_token`, ...
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(RelayError):
    pass


# An added token and how `tokenizers` cuts it out of text before anything else runs;
# `splits`: it is matched as itself (special tokens are not when special tokens are split).
AddedTokenInfo = namedtuple("AddedTokenInfo", "id content special normalized single_word lstrip rstrip splits")


class ChatTokenizer:
    """A `tokenizers` tokenizer plus what relay needs of it: chat rendering to ids,
    decoding, end-of-sequence ids, and fingerprints that artifacts record."""

    def __init__(self, backend: Tokenizer, source: str, special_tokens: Mapping[str, str],
                 chat_template: str | None, extra_eos_ids: list[int] | None = None,
                 clean_up_spaces: bool = False, split_special_tokens: bool = False) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._chat_template = chat_template
        self._compiled = None
        self._split_special = bool(split_special_tokens)
        self._clean_up = bool(clean_up_spaces)
        # transformers encodes with truncation and padding off; the fingerprint and a saved
        # copy keep the tokenizer as it was written.
        self._saved_json = backend.to_str() if (backend.truncation or backend.padding) else None
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = self._split_special
        self._tok = backend
        self._fingerprint: str | None = None
        eos = set(extra_eos_ids or [])
        eos_id = self.token_id(self.special_tokens.get("eos_token"))
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids = frozenset(eos)

    # ---- loading and saving ----------------------------------------------------------
    @classmethod
    def from_dir(cls, path: Path, extra_eos_ids: list[int] | None = None) -> "ChatTokenizer":
        """A directory holding tokenizer.json and tokenizer_config.json (an HF model directory
        or relay's cache), optionally chat_template.jinja, chat_template.json, special_tokens_map.json."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json there; relay reads the fast-tokenizer file that "
                                 "transformers' save_pretrained writes, so save the tokenizer into this folder")
        config = _read_json(path / "tokenizer_config.json")
        try:
            backend = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises its own Exception type for bad files
            raise TokenizerError(f"{file}: not a readable tokenizers file ({exc}); re-save the tokenizer "
                                 "with a current transformers") from None
        special = _special_tokens(path, config)
        _add_missing_tokens(backend, config, special)
        if backend.post_processor is None:  # as transformers sets it: no effect without added special tokens
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        return cls(backend, str(path), special, _chat_template(path, config), extra_eos_ids,
                   clean_up_spaces=_cleans_up(backend, config),
                   split_special_tokens=bool(config.get("split_special_tokens", False)))

    @classmethod
    def from_gguf(cls, path: Path, extra_eos_ids: list[int] | None = None) -> "ChatTokenizer":
        """Convert the tokenizer in a GGUF file's metadata (through transformers, once)."""
        from transformers import AutoTokenizer
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as exc:
            raise TokenizerError(f"{path}: cannot build a tokenizer from the GGUF metadata ({exc})") from None
        template = hf.chat_template if isinstance(hf.chat_template, str) else None
        config = {"clean_up_tokenization_spaces": hf.clean_up_tokenization_spaces}
        return cls(Tokenizer.from_str(hf.backend_tokenizer.to_str()), str(path), hf.special_tokens_map, template,
                   extra_eos_ids, clean_up_spaces=_cleans_up(hf.backend_tokenizer, config),
                   split_special_tokens=bool(getattr(hf, "split_special_tokens", False)))

    def save(self, path: Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja: what from_dir
        (and transformers' AutoTokenizer) reads back as this tokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self._saved_json is not None:
            (path / "tokenizer.json").write_text(self._saved_json, encoding="utf-8")
        else:
            self._tok.save(str(path / "tokenizer.json"))
        config = {"tokenizer_class": "TokenizersBackend", **self.special_tokens,
                  "clean_up_tokenization_spaces": self._clean_up, "split_special_tokens": self._split_special}
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        if self._chat_template is not None:
            (path / "chat_template.jinja").write_text(self._chat_template, encoding="utf-8")

    # ---- what relay reads ------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers` object (its raw vocabulary and decoder: relaycli/engine/vocab.py)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id(self.special_tokens.get("pad_token"))

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def added_tokens(self) -> list[AddedTokenInfo]:
        return [AddedTokenInfo(i, t.content, t.special, t.normalized, t.single_word, t.lstrip, t.rstrip,
                               not (t.special and self._split_special))
                for i, t in sorted(self._tok.get_added_tokens_decoder().items())]

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the chat, exactly as transformers' apply_chat_template gives them."""
        return self.encode(self.render_text(messages, add_generation_prompt))

    def render_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not messages:
            raise TokenizerError("cannot render an empty chat; give at least one message")
        return self._template().render(messages=_chat_data(messages), tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def encode(self, text: str) -> list[int]:
        """Ids of the text, special-token strings in it read as those tokens, none added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode of each text, the texts spread over the Rust core's threads."""
        return [enc.ids for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's character span in the text."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: list[int]) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        for before, after in _CLEAN_UP if self._clean_up else ():
            text = text.replace(before, after)
        return text

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            body = self._saved_json if self._saved_json is not None else self._tok.to_str()
            self._fingerprint = hashlib.sha256(body.encode()).hexdigest()
        return self._fingerprint

    def template_fingerprint(self) -> str:
        return hashlib.sha256((self._chat_template or "").encode()).hexdigest()

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if not self._chat_template:
                raise TokenizerError(f"{self.source}: the tokenizer has no chat template; relay needs one "
                                     "to render system and user turns")
            try:
                self._compiled = _environment().from_string(self._chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise TokenizerError(f"{self.source}: the chat template is not valid Jinja ({exc}); "
                                     "fix the template") from None
        return self._compiled


# ---- the Jinja environment of transformers' chat templates -----------------------------

class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps it."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` for templates, without reach to the dict type itself."""
    __call__ = staticmethod(lambda *args, **kwargs: dict(*args, **kwargs))
    fromkeys = staticmethod(lambda *args, **kwargs: dict.fromkeys(*args, **kwargs))


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, which lead to CPython internals."""

    def __init__(*args, **kwargs):
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes "
                                                  f"on a namespace, got {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise TokenizerError(f"jinja2 {jinja2.__version__} has known sandbox escapes and chat templates are "
                             "untrusted code; upgrade it with `pip install -U 'jinja2>=3.1.6'`")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_TemplateDict(), namespace=_Namespace)
    return env


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON-like data, anything else as an inert placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses (enums, numpy scalars) lose their extra methods
        if isinstance(value, kind):
            return kind.__str__(value) if kind is str else kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _chat_data(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to a template: None values dropped, plain
    data, a message's reasoning also under `reasoning_content` and `thinking`."""
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages should be dicts, got {message!r}")
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


# ---- reading a tokenizer directory ------------------------------------------------------

def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerError(f"{file}: not readable JSON ({exc}); repair or re-save the tokenizer") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: holds {type(data).__name__}, not a JSON object; re-save the tokenizer")
    return data


def _content(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(path: Path, config: dict) -> dict[str, str]:
    """Named special tokens as transformers reads them: the config's standard and model-specific
    `*_token` entries, then (legacy) special_tokens_map.json when the config lists no added tokens."""
    values = {k: config[k] for k in NAMED_TOKENS if k in config}
    values.update({k: v for k, v in config.items() if k.endswith("_token") and k not in NAMED_TOKENS
                   and isinstance(v, str)})
    if isinstance(config.get("extra_special_tokens"), dict):
        values.update(config["extra_special_tokens"])
    if "added_tokens_decoder" not in config:
        legacy = _read_json(path / "special_tokens_map.json")
        values.update({k: v for k, v in legacy.items() if k in NAMED_TOKENS})
    return {k: c for k, v in values.items() if (c := _content(v)) is not None}


def _add_missing_tokens(backend: Tokenizer, config: dict, special: dict[str, str]) -> None:
    """Tokens the config declares that tokenizer.json lacks, added as transformers adds them."""
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    new: list[AddedToken] = []
    decoder = config.get("added_tokens_decoder")
    for _, entry in sorted((decoder if isinstance(decoder, dict) else {}).items(), key=lambda kv: int(kv[0])):
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and entry["content"] not in have:
            fields = ("single_word", "lstrip", "rstrip", "normalized", "special")
            new.append(AddedToken(entry["content"], **{f: bool(entry[f]) for f in fields if f in entry}))
            have.add(entry["content"])
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    extra = extra if isinstance(extra, list) else []  # a dict of them is part of `special` already
    for content in [*special.values(), *map(_content, extra)]:
        if content is not None and content not in have:
            new.append(AddedToken(content, special=True, normalized=False))
            have.add(content)
    if new:
        backend.add_tokens(new)


def _chat_template(path: Path, config: dict) -> str | None:
    """chat_template.jinja first, then the config's template (a string, or the one named
    "default" of a list), then a processor's chat_template.json."""
    file = path / "chat_template.jinja"
    if file.is_file():
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{file}: not readable UTF-8 text ({exc}); re-save the template") from None
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _cleans_up(backend: Tokenizer, config: dict) -> bool:
    # transformers skips the clean-up for BPE models, where it would strip real spaces.
    if not config.get("clean_up_tokenization_spaces", False):
        return False
    forced = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or bool(forced)


# transformers' clean_up_tokenization: spaces before punctuation and contractions.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))

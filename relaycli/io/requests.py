"""Request and result rows: the contract between readers, engine and writers.

`parse_request` turns one raw input row (a JSONL object, or a Parquet row as a dict)
into a validated `RequestRow`, or into an error `ResultRow` whose message names the
row (`row_label`), the field and the fix, so that one bad row never stops a job.

Fields relay does not know are allowed (a job's own columns, such as labels, ride along in
the input; the output holds relay's columns only), except one whose name is close to a
known field's: that is a typo that would silently change the answer (`max_token` runs with
the default max_tokens), so the row is an error row naming the field it likely means.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

from relaycli.errors import ConfigError, clipped
from relaycli.io.module_field import is_pml_prompt, parse_modules as _modules, parse_pml_prompt
from relaycli.io.values import is_int as _is_int, is_text as _is_text, show as _show
from relaycli.io.structured import (CONSTRAINT_FIELDS, MAX_N, MAX_TOP_LOGPROBS, ConstraintSpec, StructuredError,
                                    parse_constraint, parse_logprobs, parse_n)

FINISH_REASONS = ("stop", "length", "error")
ROLES = ("system", "user", "assistant")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
SEED_LIMIT = 1 << 63  # seeds must fit a signed int64: torch and numpy generators take them
_MASK64 = (1 << 64) - 1


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


_SURROGATE_FIX = "holds a lone surrogate escape (such as \\ud800), which is not text; fix that escape in the input"


def _quoted(text: str) -> str:
    """A value as JSON text (one line, double quotes), cut to a readable length."""
    shown = json.dumps(text, ensure_ascii=False)
    return shown if len(shown) <= 40 else clipped(shown, 39) + '"'  # still quoted


def row_label(row_index: int, line: int | None = None, row_id: str | None = None) -> str:
    """How an error row names its row: the row index, then where a user finds it in the
    input: the JSONL line (blank lines are no rows, so the two part ways) and the row's own
    id, e.g. `row 14 (line 16, id "abc")`; `row 14 (id "abc")` for Parquet, which has no lines."""
    where = []
    if line is not None:
        where.append(f"line {line}")
    if row_id is not None:
        where.append(f"id {_quoted(row_id)}")
    return f"row {row_index} ({', '.join(where)})" if where else f"row {row_index}"


def derive_seed(seed_base: int, row_index: int) -> int:
    """The seed of a row that has none: splitmix64 of (base, row), never Python's hash().

    hash() is salted per process, so it would give a different answer on every run;
    this gives the same seed for the same job, on any machine, before or after --resume.
    """
    x = (seed_base * 0x9E3779B97F4A7C15 + row_index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # drop one bit: 0 <= seed < 2**63


@dataclass
class SamplingParams:
    max_tokens: int | None = None  # None: until EOS or the context is full
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None  # None = off (no -1 / 0 sentinels)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; else alternatives per token (0..20)
    n: int = 1  # completions of the row

    def __post_init__(self) -> None:
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer from 0 to {MAX_TOP_LOGPROBS}, "
                             f"got {_show(self.logprobs)}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer from 1 to {MAX_N}, got {_show(self.n)}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {_show(self.max_tokens)}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {_show(self.temperature)}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {_show(self.top_p)}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 (leave it out to turn it off), got {_show(self.top_k)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer from 0 to 2**63-1, got {_show(self.seed)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {_show(self.stop)}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {_show(self.ignore_eos)}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)


@dataclass
class RequestDefaults:
    """Job-wide values for rows that leave a sampling field out (the CLI options)."""

    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed_base: int = 0  # a row without a seed gets derive_seed(seed_base, row_index)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.seed_base) or not 0 <= self.seed_base < SEED_LIMIT:
            # as a row's own seed: a wider range would fold onto it (-1 and 2**64-1 gave one job)
            raise ConfigError(f"--seed must be an integer from 0 to 2**63-1, got {_show(self.seed_base)}")
        # One rule set: the defaults must themselves be valid sampling values.
        try:
            SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                           top_k=self.top_k, ignore_eos=self.ignore_eos)
        except ValueError as e:  # its message starts with the field, which is an option here
            name, _, rest = str(e).partition(" ")
            raise ConfigError(f"--{name.replace('_', '-')} {rest}") from None


def check_messages(messages: Any) -> None:
    """Raise ValueError naming the first bad message; the engine's chat templates rely on these."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {_show(m)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {_show(role)}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {_show(content)}")
        if not _is_text(content):
            raise ValueError(f"messages[{i}].content {_SURROGATE_FIX}")
        if not content.strip():
            raise ValueError(f"messages[{i}].content is empty; give the message some text")
        if role == "system" and i > 0:
            raise ValueError(f"messages[{i}] is a system message; only the first message may be one")
    if all(m["role"] == "system" for m in messages):
        raise ValueError("messages holds only a system message; add a user message to answer")


@dataclass
class RequestRow:
    row_index: int
    id: str
    messages: list[dict[str, str]]  # the chat; a bare prompt is one user message
    system_prompt: str | None = None  # names a loaded artifact
    sampling: SamplingParams = field(default_factory=SamplingParams)
    is_openai: bool = False
    url: str | None = None  # the OpenAI endpoint, so the writer can shape its answer
    # prompt modules: [{"name": module, parameter: value, ...}] of a loaded library
    modules: list[dict] | None = None
    schema: str | None = None  # names the library (its schema's or its file's name)
    constraint: ConstraintSpec | None = None  # what the answer must match (schema, regex, choices, grammar)
    line: int | None = field(default=None, compare=False)  # its JSONL line (1-based), where the input has lines

    def __post_init__(self) -> None:
        if not _is_int(self.row_index) or self.row_index < 0:
            raise ValueError(f"row_index must be an integer >= 0, got {_show(self.row_index)}")
        if self.line is not None and (not _is_int(self.line) or self.line < 1):
            raise ValueError(f"line must be an integer >= 1, got {_show(self.line)}")
        if self.modules is not None:
            self.modules = _modules(self.modules)
        if self.schema is not None and (not _is_text(self.schema) or not self.schema):
            raise ValueError(f"schema must be a non-empty string, got {_show(self.schema)}")
        if not isinstance(self.id, str):
            raise ValueError(f"id must be a string, got {_show(self.id)}")
        if self.constraint is not None and not isinstance(self.constraint, ConstraintSpec):
            raise ValueError(f"constraint must be a ConstraintSpec, got {type(self.constraint).__name__}")
        check_messages(self.messages)
        if self.system_prompt is not None and (not isinstance(self.system_prompt, str) or not self.system_prompt):
            raise ValueError(f"system_prompt must be a non-empty string, got {_show(self.system_prompt)}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.url is not None and self.url not in OPENAI_URLS:
            raise ValueError(f"url must be one of {', '.join(OPENAI_URLS)}, got {_show(self.url)}")

    @property
    def label(self) -> str:
        """How an error row names this row (row_label): index, line, and id where it is the
        row's own (an id that only repeats the index is left out)."""
        return row_label(self.row_index, self.line, None if self.id == str(self.row_index) else self.id)


@dataclass
class ResultRow:
    row_index: int
    id: str
    text: str
    finish_reason: str  # stop | length | error
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a shared prefix artifact
    completion_tokens: int = 0
    error: str | None = None  # set exactly when finish_reason == "error"
    url: str | None = None  # carried from the request for OpenAI-format output
    # per generated token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}; None: not asked
    logprobs: list[dict] | None = None
    # n > 1: every completion {index, text, finish_reason, completion_tokens, logprobs}; the
    # row's own text, finish_reason and logprobs are those of completion 0
    completions: list[dict] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.row_index) or self.row_index < 0:
            raise ValueError(f"row_index must be an integer >= 0, got {_show(self.row_index)}")
        if not isinstance(self.id, str) or not isinstance(self.text, str):
            raise ValueError("id and text must be strings")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {', '.join(FINISH_REASONS)}, got {_show(self.finish_reason)}")
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {_show(value)}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})")
        if (self.finish_reason == "error") != isinstance(self.error, str) or self.error == "":
            raise ValueError("error must be a non-empty message exactly when finish_reason is 'error'")

    @classmethod
    def failed(cls, row_index: int, id: str, error: str, url: str | None = None) -> ResultRow:
        return cls(row_index=row_index, id=id, text="", finish_reason="error", error=error, url=url)


class _RowError(ValueError):
    """A complete one-line message (what is wrong and how to fix it)."""


def _opt(src: dict, key: str, integer: bool) -> Any:
    """The field's value if it has the right type, None if absent; a clear error otherwise."""
    v = src.get(key)
    if integer and isinstance(v, float) and v.is_integer():
        v = int(v)  # pandas turns an int column with nulls into float64: 64.0 means 64
    if v is not None and not (_is_int(v) if integer else _is_number(v)):
        raise _RowError(f"'{key}' must be {'an integer' if integer else 'a finite number'}, got {_show(v)}; "
                        "fix the value or leave the field out to use the default")
    return v


def _content_text(content: Any, i: int) -> Any:
    """OpenAI allows content as a list of parts; we take text parts and join them."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _RowError(f"messages[{i}].content has a part that is not {{type: text, text: ...}}; "
                            "relay reads text only")
        texts.append(part["text"])
    return "".join(texts)


def _messages(src: dict) -> list[dict[str, str]]:
    has_prompt, has_messages = "prompt" in src, "messages" in src
    if has_prompt and has_messages:
        raise _RowError("has both 'prompt' and 'messages'; keep one of them")
    if not has_prompt and not has_messages:
        raise _RowError("needs a 'prompt' (a string) or 'messages' (a list of {role, content}); add one")
    if has_prompt:
        prompt = src["prompt"]
        if not isinstance(prompt, str):
            raise _RowError(f"'prompt' must be a string, got {_show(prompt)}")
        if not prompt.strip():
            raise _RowError("'prompt' is empty; give it the user's message")
        if not _is_text(prompt):
            raise _RowError(f"'prompt' {_SURROGATE_FIX}")
        return [{"role": "user", "content": prompt}]
    raw = src["messages"]
    if isinstance(raw, list):
        # Keep role and content only; a Parquet struct brings null fields, which mean absent.
        # OpenAI's "developer" role is its newer name for the system message.
        raw = [{"role": "system" if m.get("role") == "developer" else m.get("role"),
                "content": _content_text(m.get("content"), i)}
               if isinstance(m, dict) else m for i, m in enumerate(raw)]
    try:
        check_messages(raw)
    except ValueError as e:
        raise _RowError(str(e)) from None
    return raw


def _stop(src: dict) -> list[str]:
    v = src.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _RowError(f"'stop' must be a string or a list of strings, got {_show(v)}")
    if not all(v):
        raise _RowError("'stop' holds an empty string; remove it")
    if not all(map(_is_text, v)):
        raise _RowError(f"'stop' {_SURROGATE_FIX}")
    return v


# Request fields relay does not implement, with the values that ask for nothing: any other
# value would change the answer, so it is this row's error rather than silently ignored.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "tools": [], "functions": []}


def _is_neutral(v: Any, neutral: Any) -> bool:
    if isinstance(v, bool) or isinstance(neutral, bool):
        return v is neutral  # true is not n = 1, and 0 is not logprobs = false
    return v == neutral


def _check_unsupported(src: dict) -> None:
    for key, neutral in _NEUTRAL.items():
        if key in src and not _is_neutral(src[key], neutral):
            raise _RowError(f"'{key}' = {_show(src[key])} is not supported (relay does not implement it); "
                            "remove the field")


# Every field a request row or an OpenAI Batch line may hold that relay reads (or, for
# OpenAI's `model`, knowingly leaves to the job's --model).
KNOWN_FIELDS = frozenset({
    "id", "prompt", "messages", "system_prompt", "modules", "schema", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "top_logprobs", "n",
    *CONSTRAINT_FIELDS, *_NEUTRAL, "custom_id", "method", "url", "body", "model"})
# Names relay writes itself (a result row's fields) are no typos: an earlier job's answers
# (completion_tokens beside max_completion_tokens) may ride along in a later job's input.
_RELAY_NAMES = KNOWN_FIELDS | {f.name for f in fields(ResultRow)}
# One- and two-letter names: any short column is "close" to them, so they match only when
# equal up to case (`ID`), never by likeness (`ids`, `uid` stay a job's own columns).
_LIKENESS_FIELDS = sorted(f for f in KNOWN_FIELDS if len(f) > 2)


@lru_cache(maxsize=4096)
def likely_field(key: str) -> str | None:
    """The known field an unknown field name is likely a typo of, or None: equal up to
    case, '-' or ' ' for '_', or a difflib ratio of at least 0.8 (`max_token`, `temprature`,
    `topP`). Cached: a job's rows repeat the same names."""
    name = key.strip().lower().replace("-", "_").replace(" ", "_")
    if name in KNOWN_FIELDS:
        return name
    if any(name.startswith(f + "_") or name.endswith("_" + f) for f in KNOWN_FIELDS):
        return None  # a known field's name extended (`prompt_id`, `my_prompt`): a column of its own
    close = difflib.get_close_matches(name, _LIKENESS_FIELDS, n=1, cutoff=0.8)
    return close[0] if close else None


def _check_typos(row: dict) -> None:
    for key in row:
        if key in _RELAY_NAMES or not isinstance(key, str):
            continue
        guess = likely_field(key)
        if guess is not None:
            raise _RowError(f"unknown field {key!r}; did you mean {guess!r}? Rename it (a column of your own "
                            "needs a name unlike relay's fields)")


def _row_id(raw: dict, key: str, row_index: int) -> str:
    v = raw.get(key)
    if v is None:
        return str(row_index)
    if _is_int(v):
        return str(v)
    if not isinstance(v, str) or not v:
        raise _RowError(f"'{key}' must be a non-empty string, got {_show(v)}")
    if not _is_text(v):
        raise _RowError(f"'{key}' {_SURROGATE_FIX}")
    return v


def _own_id(raw: Any) -> str | None:
    """The row's own id (an OpenAI line's custom_id) where it is usable, else None."""
    if isinstance(raw, dict):
        for key in ("custom_id", "id"):
            v = raw.get(key)
            if (_is_text(v) and v) or _is_int(v):
                return str(v)
    return None


def _openai_parts(raw: dict) -> tuple[dict, str]:
    """Check the envelope of an OpenAI Batch line; return (body, url)."""
    body = raw.get("body")
    if not isinstance(body, dict):
        raise _RowError("'body' must be an object holding 'messages' or 'prompt' (OpenAI Batch format)")
    body = {k: v for k, v in body.items() if v is not None}
    method = raw.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        raise _RowError(f"'method' must be \"POST\", got {_show(method)}")
    url = raw.get("url")
    if url is None:  # not required by us: the body says which endpoint it is for
        url = OPENAI_URLS[1] if "prompt" in body and "messages" not in body else OPENAI_URLS[0]
    if url not in OPENAI_URLS:
        raise _RowError(f"'url' must be {' or '.join(OPENAI_URLS)}, got {_show(url)}")
    if url == OPENAI_URLS[0] and "prompt" in body and "messages" not in body:
        raise _RowError("url /v1/chat/completions takes body.messages; use url /v1/completions for body.prompt")
    if url == OPENAI_URLS[1] and "messages" in body:
        raise _RowError("url /v1/completions takes body.prompt; use url /v1/chat/completions for body.messages")
    return body, url


def _parse(raw: Any, row_index: int, d: RequestDefaults, line: int | None) -> RequestRow:
    if not isinstance(raw, dict):
        kind = "empty" if raw is None else f"a {type(raw).__name__}"
        raise _RowError(f"the row is {kind}, not an object; write one JSON object with 'prompt' or 'messages'")
    raw = {k: v for k, v in raw.items() if v is not None}  # null means absent (Parquet and JSON)
    _check_typos(raw)
    is_openai = "body" in raw or "custom_id" in raw
    url = None
    if is_openai:
        body, url = _openai_parts(raw)
        _check_typos(body)
        content_src, src, row_id = body, {**raw, **body}, _row_id(raw, "custom_id", row_index)
    else:
        content_src, src, row_id = raw, raw, _row_id(raw, "id", row_index)
    pml = None  # Prompt Cache's form: the prompt names its modules inline
    if isinstance(content_src.get("prompt"), str) and is_pml_prompt(content_src["prompt"]):
        try:
            pml = parse_pml_prompt(content_src["prompt"])
        except ValueError as e:
            raise _RowError(f"'prompt' is a PML prompt, but {e} (text meant as it is goes in 'messages')") from None
        content_src = {**content_src, "prompt": pml[2]}
    messages = _messages(content_src)
    _check_unsupported(src)
    system_prompt = src.get("system_prompt")
    if system_prompt is not None and (not _is_text(system_prompt) or not system_prompt):
        raise _RowError(f"'system_prompt' must be the name of a loaded prompt artifact, got {_show(system_prompt)}")
    if system_prompt is not None and messages[0]["role"] == "system":
        raise _RowError("has both 'system_prompt' and a system message; keep one of them")
    modules, schema = src.get("modules"), src.get("schema")
    if pml is not None:
        if modules is not None:
            raise _RowError("names modules both in its PML 'prompt' and in 'modules'; keep one of them")
        if schema is not None and pml[0] is not None and schema != pml[0]:
            raise _RowError(f"'schema' is {_show(schema)} but its PML prompt says schema={_show(pml[0])}; keep one")
        modules, schema = pml[1], schema if schema is not None else pml[0]
    if schema is not None and (not _is_text(schema) or not schema):
        raise _RowError(f"'schema' must be the name of a loaded module library, got {_show(schema)}")
    if schema is not None and system_prompt is not None:
        raise _RowError("has both 'schema' and 'system_prompt'; keep one of them (a library brings its system text)")
    if modules is not None:
        try:
            modules = _modules(modules)
        except ValueError as e:
            raise _RowError(f"{e}; fix the list") from None
    max_tokens = _opt(src, "max_tokens", True)
    alias = _opt(src, "max_completion_tokens", True)
    if max_tokens is not None and alias is not None and alias != max_tokens:
        raise _RowError("'max_tokens' and 'max_completion_tokens' disagree; keep one of them")
    max_tokens = max_tokens if max_tokens is not None else alias
    ignore_eos = src.get("ignore_eos", d.ignore_eos)
    if not isinstance(ignore_eos, bool):
        raise _RowError(f"'ignore_eos' must be true or false, got {_show(ignore_eos)}")
    values = {"max_tokens": max_tokens, "temperature": _opt(src, "temperature", False),
              "top_p": _opt(src, "top_p", False), "top_k": _opt(src, "top_k", True), "seed": _opt(src, "seed", True)}
    fallback = {"max_tokens": d.max_tokens, "temperature": d.temperature, "top_p": d.top_p,
                "top_k": d.top_k, "seed": derive_seed(d.seed_base, row_index)}
    chosen = {k: v if v is not None else fallback[k] for k, v in values.items()}
    stop = _stop(src)
    try:
        logprobs, n, constraint = parse_logprobs(src), parse_n(src), parse_constraint(src)
    except StructuredError as e:
        raise _RowError(str(e)) from None
    try:
        sampling = SamplingParams(**chosen, stop=stop, ignore_eos=ignore_eos, logprobs=logprobs, n=n)
    except ValueError as e:  # a range rule of SamplingParams; its message starts with the field
        name, _, rest = str(e).partition(" ")
        raise _RowError(f"'{name}' {rest}; fix the value or leave the field out to use the default") from None
    return RequestRow(row_index=row_index, id=row_id, messages=messages, system_prompt=system_prompt,
                      sampling=sampling, is_openai=is_openai, url=url, modules=modules, schema=schema,
                      constraint=constraint, line=line)


def parse_request(raw: dict | None, row_index: int, defaults: RequestDefaults | None = None,
                  line: int | None = None) -> RequestRow | ResultRow:
    """A valid row becomes a RequestRow; a bad one an error ResultRow (the job goes on),
    whose message names the row by row_label: its index, its JSONL line (line, where the
    input has lines) and its own id."""
    try:
        return _parse(raw, row_index, defaults if defaults is not None else RequestDefaults(), line)
    except _RowError as e:
        url = raw.get("url") if isinstance(raw, dict) and raw.get("url") in OPENAI_URLS else None
        own = _own_id(raw)
        return ResultRow.failed(row_index, own if own is not None else str(row_index),
                                f"{row_label(row_index, line, own)}: {e}", url=url)

"""The structured-answer fields of a request row: logprobs, n, and one answer constraint.

Torch-free and xgrammar-free: this checks the fields' shapes and turns them into plain
values; whether a schema, regex or grammar compiles is the engine's check
(relaycli/engine/constraints.py), which makes the row an error row naming the field.

Fields (relay rows and OpenAI Batch bodies alike):
- `logprobs`: true/false (chat), or an integer k (the completions endpoint: k alternatives);
  `top_logprobs`: 0..20 alternatives per token, needs `logprobs`.
- `n`: 1..MAX_N completions of the row.
- one constraint: `response_format` (`json_object`, `json_schema`), `json_schema`, `regex`,
  `choices` (a list of strings: the answer is exactly one), `grammar` (EBNF, rule `root`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from relaycli.io.values import is_int as _is_int, show as _show

MAX_N = 16  # completions one row may ask for
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
CONSTRAINT_FIELDS = ("response_format", "json_schema", "regex", "choices", "grammar")
STRUCTURED_FIX = "pip install 'relay-batch[structured]'"


class StructuredError(ValueError):
    """A complete one-line message naming the field and the fix."""


@dataclass(frozen=True)
class ConstraintSpec:
    """What a row's answer must match. kind: json_object | json_schema | regex | choices |
    grammar; source: the schema (a dict or bool), the pattern, the list of choices, the
    grammar text (None for json_object); strict: JSON-schema objects take no property the
    schema does not name; field: the row field it came from (for error messages)."""

    kind: str
    source: Any
    field: str
    strict: bool = True

    @property
    def key(self) -> str:
        """One text per distinct constraint: the compile cache's key."""
        return json.dumps([self.kind, self.source, self.strict], sort_keys=True, ensure_ascii=False)


def parse_logprobs(src: dict) -> int | None:
    """None (no logprobs) or the number of alternatives per token (0..20)."""
    lp, top = src.get("logprobs"), src.get("top_logprobs")
    if isinstance(top, float) and top.is_integer():
        top = int(top)
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise StructuredError(f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {_show(top)}; "
                              "fix the value")
    if lp is None or lp is False:
        if top:
            raise StructuredError("'top_logprobs' needs 'logprobs': true; add it or remove 'top_logprobs'")
        return None
    if lp is True:
        return top or 0
    if _is_int(lp) and 0 <= lp <= MAX_TOP_LOGPROBS:  # the completions endpoint: logprobs = k
        if top is not None and top != lp:
            raise StructuredError("'logprobs' and 'top_logprobs' disagree; keep one of them")
        return lp
    raise StructuredError(f"'logprobs' must be true, false or an integer from 0 to {MAX_TOP_LOGPROBS}, "
                          f"got {_show(lp)}; fix the value")


def parse_n(src: dict) -> int:
    n = src.get("n", 1)
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if not _is_int(n) or not 1 <= n <= MAX_N:
        fix = ("lower it, or repeat the row with other seeds for more answers" if _is_int(n) and n > MAX_N
               else f"set it from 1 to {MAX_N}, or leave it out for one answer")
        raise StructuredError(f"'n' must be an integer from 1 to {MAX_N}, got {_show(n)}; {fix}")
    return n


def _schema(value: Any, field: str) -> Any:
    """A JSON schema: an object or a boolean, or a string holding one (Parquet rows)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise StructuredError(f"'{field}' is a string but not JSON; give the schema as an object or "
                                  "as JSON text") from None
    if not isinstance(value, (dict, bool)):
        raise StructuredError(f"'{field}' must be a JSON schema (an object), got {_show(value)}")
    return value


def _response_format(rf: Any) -> ConstraintSpec | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise StructuredError(f"'response_format' must be an object with a 'type', got {_show(rf)}")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", None, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise StructuredError("'response_format.json_schema' must be an object holding 'schema'; add the schema")
        strict = js.get("strict", True)  # a schema given is a schema kept: `strict: false` opts out
        if not isinstance(strict, bool):
            raise StructuredError(f"'response_format.json_schema.strict' must be true or false, got {_show(strict)}")
        return ConstraintSpec("json_schema", _schema(js["schema"], "response_format.json_schema.schema"),
                              "response_format", strict)
    raise StructuredError(f"'response_format.type' must be text, json_object or json_schema, got {_show(kind)}")


def parse_constraint(src: dict) -> ConstraintSpec | None:
    """The row's one constraint, or None."""
    given = [f for f in CONSTRAINT_FIELDS if f in src]
    if len(given) > 1:
        raise StructuredError(f"has {' and '.join(repr(f) for f in given)}; keep one constraint")
    if not given:
        return None
    field = given[0]
    value = src[field]
    if field == "response_format":
        return _response_format(value)
    if field == "json_schema":
        return ConstraintSpec("json_schema", _schema(value, field), field)
    if field == "choices":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise StructuredError(f"'choices' must be a non-empty list of non-empty strings, got {_show(value)}")
        return ConstraintSpec("choices", list(dict.fromkeys(value)), field)
    if not isinstance(value, str) or not value.strip():
        what = "a regular expression" if field == "regex" else "an EBNF grammar with a rule named root"
        raise StructuredError(f"'{field}' must be a non-empty string holding {what}, got {_show(value)}")
    return ConstraintSpec(field, value, field)

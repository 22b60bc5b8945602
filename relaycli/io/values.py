"""Checks and renderings of values that every field's parser and every refusal shares."""

from __future__ import annotations

from typing import Any

from relaycli.errors import clipped


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_text(v: Any) -> bool:
    """A str that UTF-8 can hold. JSON's "\\ud800" escape decodes to a lone surrogate, a
    str that no tokenizer or file writer takes, so it must stop at its own row."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def show(v: Any) -> str:
    """A short repr for error lines (a 10 kB prompt must not flood the error column)."""
    try:
        text = repr(v)
    except RecursionError:  # a value nested as deep as the JSON reader allows
        return f"a deeply nested {type(v).__name__}"
    return clipped(text, 60)

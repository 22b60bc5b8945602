"""The structured-answer fields of a request row, checked for shape. Torch-free.

- `logprobs`: true/false (chat), or an integer k (the completions endpoint: k alternatives);
  `top_logprobs`: 0..20 alternatives per token, needs `logprobs`.
"""

from __future__ import annotations

from typing import Any

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows


class StructuredError(ValueError):
    """A complete one-line message naming the field and the fix."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


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

"""The one error type a user acts on.

A `RelayError` is a refusal, not a bug: its message is one sentence that names the file,
option or row and says the fix. The CLI prints it as one line and exits with status 2;
anything else that escapes is a defect and keeps its traceback. Each layer raises its
own subclass (a model, a tokenizer, an artifact, an input or output file, an option).
It is a ValueError, as every such refusal was a bad value somewhere.
"""

from __future__ import annotations


class RelayError(ValueError):
    """A refusal the user can act on; the message names what and how to fix it."""


class ConfigError(RelayError):
    """An option or setting that cannot work (a batch limit, a cache size, a device)."""


def clipped(text: str, limit: int = 40) -> str:
    """text, or its first limit - 3 characters and "..." where it is longer: what a
    one-line error shows of a value."""
    return text if len(text) <= limit else text[:limit - 3] + "..."

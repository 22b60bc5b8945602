"""Stop strings, checked as tokens arrive, at a cost independent of the output's length.

Decoding a row's whole output after every token to look for its stop strings costs
O(n) a token, O(n^2) a row. `StopWatch` keeps the text decoded so far and decodes only
a short window of recent tokens a step: the text of the newest tokens is the decode of
the window minus the decode of its older part (both start at the same token, so
decoders that treat a first token specially, or byte-level tokens that split a UTF-8
character, give the same text as a full decode). A window whose text ends in an
incomplete character (U+FFFD) waits for the next token. Each step searches only the new
text plus the last (longest stop - 1) characters before it.

The answer's text is still the decode of all its tokens, cut at the first stop string
found in that text (engine._result); this class only decides when a row stops.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


class StopWatch:
    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.decode = decode
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the decode of ids[:read_offset]
        self.prefix_offset = 0  # the window's first token
        self.read_offset = 0  # tokens whose text is in self.text

    def push(self, ids: list[int], end: int) -> int | None:
        """ids[:end]: the output so far (tokens past end are placeholders of steps in flight).
        Returns where the first stop string starts in the output's text, or None."""
        new = self.decode(ids[self.prefix_offset:end])
        old = self.decode(ids[self.prefix_offset:self.read_offset]) if self.read_offset > self.prefix_offset else ""
        if len(new) <= len(old) or new.endswith(REPLACEMENT):
            return None  # no whole character yet
        start = max(0, len(self.text) - self.longest + 1)
        self.text += new[len(old):]
        self.prefix_offset, self.read_offset = self.read_offset, end
        return first_stop(self.text, self.stops, start)


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest of the stop strings begins in text at or after start, or None."""
    cuts = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(cuts) if cuts else None

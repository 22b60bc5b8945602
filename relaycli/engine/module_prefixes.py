"""Rows that name prompt modules: their library, their token ids, and their shared prefix.

A row's shared prefix is its library's system KV followed by its chosen modules' KV, one
loaded prefix per distinct path, built the first time a row of the job needs it: the rows
of one path form one prefix group, its KV read once per step for all of them, by the same
machinery as several `--prompt` artifacts. A path stays loaded while there is room; when a
new one finds none, the paths no queued or running row uses are dropped, least recently
used first, and built again if a later row needs them. Where the paths in use hold the
room, the new path's rows wait for them (PrefixRoomBusy), so a library larger than the
device's memory runs at the speed its row order allows (rows sorted by module path load
each path once).
"""

from __future__ import annotations

import itertools
from typing import Callable

from relaycli.engine.model_runner import ModelRunner, PrefixKV
from relaycli.io.requests import RequestRow
from relaycli.module_rows import Library, ModulePick
from relaycli.prompts import PreparedPrompt, PromptError, PromptMatcher


def path_tokens(artifacts: list) -> int:
    """Prefix tokens the libraries' paths take when every module's own path is loaded (the
    system prompt and the module's chain of parents, then the module): room the engine keeps
    for the paths it builds while it runs. Rows of an independent library may combine
    modules into more paths than this counts; those grow the room when they come."""
    total = 0
    for art in artifacts:
        if getattr(art, "is_library", False):
            lengths = {seg["name"]: seg["end"] - seg["start"] for seg in art.meta["segments"]}
            total += sum(sum(lengths[a] for a in seg["after"]) + lengths[seg["name"]]
                         for seg in art.meta["segments"][1:])
    return total


class PrefixRoomBusy(Exception):
    """No room for a module path until rows of the paths in use finish."""


class ModulePrefixes:
    def __init__(self, artifacts: list, runner: ModelRunner) -> None:
        self.artifacts, self.runner = artifacts, runner
        self.libraries = [Library(i, a.name, a.meta) for i, a in enumerate(artifacts) if getattr(a, "is_library", False)]
        self.by_name: dict[str, Library] = {}
        for lib in self.libraries:  # a file's name first: it is what --prompt shows
            self.by_name.setdefault(lib.file_name, lib)
        for lib in self.libraries:
            self.by_name.setdefault(lib.name, lib)
        self.slots: dict[tuple[int, tuple[str, ...]], int] = {}  # (library, path) -> loaded prefix
        self._last_use: dict[int, int] = {}  # slot -> tick of the row that last asked for it
        self._ticks = itertools.count()
        self.built = 0
        self.dropped = 0  # paths dropped to make room (each built again if a row needs it)

    @staticmethod
    def wants(row: RequestRow) -> bool:
        return getattr(row, "modules", None) is not None or getattr(row, "schema", None) is not None

    def _library(self, row: RequestRow) -> Library:
        if row.schema is not None:
            lib = self.by_name.get(row.schema)
            if lib is None:
                loaded = ", ".join(sorted(self.by_name)) or "none"
                raise PromptError(f"schema {row.schema!r} names no loaded module library (loaded: {loaded}); "
                                  "pass the library with --prompt or fix the name")
            return lib
        if len(self.libraries) != 1:
            if not self.libraries:
                raise PromptError("the row names modules and no module library is loaded; compile the schema "
                                  "with `relay compile-prompt SCHEMA.pml` and pass it with --prompt")
            names = ", ".join(lib.file_name for lib in self.libraries)
            raise PromptError(f"the row names modules and several libraries are loaded ({names}); name one in "
                              "'schema'")
        return self.libraries[0]

    def prepare(self, matcher: PromptMatcher, tokenizer, row: RequestRow) -> tuple[PreparedPrompt, ModulePick | None]:
        """The row's own ids (after its library's system prefix) and its modules; PromptError
        when the row and its library do not fit together."""
        lib = self._library(row)
        art = self.artifacts[lib.slot]
        messages = row.messages
        if messages[0]["role"] == "system":
            if messages[0]["content"] != art.system_text:
                raise PromptError(f"the row's system message is not the system text of library {lib.name!r}; "
                                  "remove it (the library brings its own)")
            messages = messages[1:]
        prepared = matcher.prepare(messages, art.name)
        if prepared.prefix_slot != lib.slot:
            raise PromptError(f"the row's chat does not start with the system prefix of library {lib.name!r} "
                              "once rendered; give the chat without a system message")
        if not row.modules:
            return prepared, None
        return prepared, lib.pick(tokenizer, row.modules)

    def slot(self, pick: ModulePick, in_use: Callable[[], set[int]]) -> int:
        """The loaded prefix of a path, built when it is not loaded (on the engine's thread).
        in_use: the prefix slots that queued or running sequences use. PrefixRoomBusy where
        only paths in use hold the room it needs; ConfigError where the device (or
        --prefix-cache-gb) cannot hold it even alone."""
        key = (pick.library, pick.path)
        if key not in self.slots:
            art = self.artifacts[pick.library]
            rows = next(lib for lib in self.libraries if lib.slot == pick.library).rows(pick.path)
            self._make_room(sum(b - a for a, b in rows), in_use)
            pieces = [PrefixKV([k[a:b] for k in art.keys], [v[a:b] for v in art.values]) for a, b in rows]
            self.slots[key] = self.runner.add_prefix(pieces)
            self.built += 1
        self._last_use[self.slots[key]] = next(self._ticks)
        return self.slots[key]

    def _make_room(self, tokens: int, in_use: Callable[[], set[int]]) -> None:
        """Drop unused paths, least recently used first, until `tokens` rows fit. Where the
        unused ones cannot free enough, nothing is dropped: under --prefix-cache-gb the
        path waits (PrefixRoomBusy) while paths in use hold the rest, or is refused where it
        could never fit; without it add_prefix grows the store (or says it cannot)."""
        room = self.runner.prefix_room()
        if room is None or tokens <= room:
            return
        self.runner.check_prefix_bound(tokens)
        busy = in_use()
        victims = []
        for slot in sorted(self._last_use, key=self._last_use.get):
            if room >= tokens:
                break
            if slot not in busy:
                victims.append(slot)
                room += self.runner.prefixes[slot].num_tokens
        if room < tokens:
            if self.runner.max_prefix_tokens is not None and busy & self._last_use.keys():
                raise PrefixRoomBusy
            return
        self.runner.drop_prefixes(set(victims))
        for slot in victims:
            del self._last_use[slot]
        self.slots = {k: s for k, s in self.slots.items() if s not in victims}
        self.dropped += len(victims)

"""A row's `modules` against a loaded library: which segments its prefix is made of.

The model sees one token sequence: the system prefix, the chosen modules' tokens in schema
order, then, for a module with parameters, each value's tokens and the module's text after
them, then the row's own tokens (its rendered chat after the system prefix). The cached
part (system and modules) is the row's shared prefix; the rest is the row's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaycli.prompts import PromptError


@dataclass(frozen=True)
class ModulePick:
    """What a row chose: the library's slot, its modules in schema order, the ids that go
    before its own (parameter values and the text after them), and the position its own
    tokens start at (None: right after the prefix)."""

    library: int
    path: tuple[str, ...]
    extra_ids: tuple[int, ...]
    next_position: int | None


class Library:
    """A format-2 artifact's modules (relaycli.segments), as rows pick them."""

    def __init__(self, slot: int, name: str, meta: dict) -> None:
        self.slot, self.file_name = slot, name
        schema = meta["schema"]
        self.name, self.mode, self.next_position = schema["name"], schema["mode"], schema["next_position"]
        self.segments = {s["name"]: s for s in meta["segments"][1:]}
        self.order = {name: i for i, name in enumerate(self.segments)}
        self.num_system = len(meta["token_ids"])

    def rows(self, path: tuple[str, ...]) -> list[tuple[int, int]]:
        """KV rows of the prefix of a path: the system prompt's, then each module's."""
        return [(0, self.num_system)] + [(self.segments[n]["start"], self.segments[n]["end"]) for n in path]

    def _unknown(self, name: str) -> PromptError:
        names = list(self.segments)
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        return PromptError(f"module {name!r} is not in library {self.name!r} (its modules: {shown}); fix the name")

    def pick(self, tokenizer, modules: list[dict]) -> ModulePick:
        chosen: dict[str, dict] = {}
        for item in modules:
            name = item["name"]
            if name not in self.segments:
                raise self._unknown(name)
            if name in chosen:
                raise PromptError(f"module {name!r} is named twice; name it once")
            chosen[name] = {k: v for k, v in item.items() if k != "name"}
        path = tuple(sorted(chosen, key=self.order.__getitem__))
        unions: dict[int, str] = {}
        for name in path:
            union = self.segments[name]["union"]
            if union is not None and union in unions:
                raise PromptError(f"modules {unions[union]!r} and {name!r} are alternatives of one union; "
                                  "pick one of them")
            if union is not None:
                unions[union] = name
        if self.mode == "exact":
            self._check_path(path)
        extra: list[int] = []
        next_position = None
        for name in path:
            seg = self.segments[name]
            extra += self._fill(name, seg["rest"], chosen[name], tokenizer)
            if seg["rest"] and self.mode == "independent":
                next_position = seg["position"] + seg["end"] - seg["start"]
        if self.mode == "independent" and next_position is None:
            next_position = self.next_position
        return ModulePick(self.slot, path, tuple(extra), next_position)

    def _check_path(self, path: tuple[str, ...]) -> None:
        """Exact modules: the chosen ones must be one chain from a root, each after the one before."""
        chosen = set(path)
        previous = "system"
        for name in path:
            parent = self.segments[name]["after"][-1]
            if parent == previous:
                previous = name
                continue
            if parent not in chosen:
                raise PromptError(f"module {name!r} is computed after {parent!r}, which the row does not name; "
                                  f"add {parent!r} (the modules of an exact library form one path from a root)")
            raise PromptError(f"modules {previous!r} and {name!r} are on different branches of library "
                              f"{self.name!r}; pick the modules of one path from a root")

    @staticmethod
    def _fill(name: str, rest: list[dict], values: dict, tokenizer) -> list[int]:
        params = [item["parameter"] for item in rest if "parameter" in item]
        for key in values:
            if key not in params:
                has = f"its parameters: {', '.join(params)}" if params else "it has none"
                raise PromptError(f"module {name!r} has no parameter {key!r} ({has}); remove it")
        ids: list[int] = []
        for item in rest:
            if "ids" in item:
                ids += item["ids"]
                continue
            key = item["parameter"]
            if key not in values:
                raise PromptError(f"module {name!r} needs parameter {key!r}; name the module as "
                                  f'{{"name": "{name}", "{key}": "..."}}')
            value = tokenizer.encode(values[key])
            if len(value) > item["len"]:
                raise PromptError(f"parameter {key!r} of module {name!r} is {len(value)} tokens, at most "
                                  f"{item['len']} fit; shorten the value")
            ids += value
        return ids

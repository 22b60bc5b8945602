"""compile-prompt for a schema: the system prompt and every module's KV -> one library
artifact (`.relaykv` format 2; relaycli.segments says what its segments hold).

Positions: the system prompt holds 0..S-1. In an exact schema a module follows its parent
chain (a root starts at S); in an independent one the modules take consecutive ranges in
document order from S, the members of a union one shared range as wide as the widest, and
a row's own tokens start after the last range (`next_position`). A module's range covers
its text and, for a module with parameters, every parameter's `len` and the text after it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from relaycli.artifact import save_artifact
from relaycli.compile import CompileError, CompileResult, artifact_meta, prefill_kv, shared_prefix_ids
from relaycli.models.registry import LoadedModel
from relaycli.modules import Parameter, Schema

MODULE_SEPARATOR = "\n"  # a module's tokens are those of this and its text


def module_tokens(tokenizer, schema: Schema) -> dict[str, tuple[list[int], list[dict]]]:
    """Each module's cached ids (separator and text up to its first parameter) and its rest:
    [{"parameter", "len"} | {"ids"}] in order."""
    out = {}
    for m in schema.modules:
        head = tokenizer.encode(MODULE_SEPARATOR + m.head)
        rest: list[dict] = []
        for piece in m.pieces[1:]:
            if isinstance(piece, Parameter):
                rest.append({"parameter": piece.name, "len": piece.max_tokens})
            elif piece:
                rest.append({"ids": tokenizer.encode(piece)})
        out[m.name] = (head, rest)
    return out


def _width(head: list[int], rest: list[dict]) -> int:
    return len(head) + sum(item["len"] if "parameter" in item else len(item["ids"]) for item in rest)


def plan_positions(schema: Schema, tokens: dict, num_system: int) -> tuple[dict[str, int], int | None]:
    """Each module's first position, and where a row's own tokens start (independent only)."""
    pos: dict[str, int] = {}
    if schema.mode == "exact":
        for m in schema.modules:
            pos[m.name] = num_system if m.after is None else pos[m.after] + len(tokens[m.after][0])
        return pos, None
    cursor, i, mods = num_system, 0, schema.modules
    while i < len(mods):
        group = [mods[i]]
        while mods[i].union is not None and i + len(group) < len(mods) and mods[i + len(group)].union == mods[i].union:
            group.append(mods[i + len(group)])
        for m in group:
            pos[m.name] = cursor
        cursor += max(_width(*tokens[m.name]) for m in group)
        i += len(group)
    return pos, cursor


def _chain(schema: Schema, name: str) -> list[str]:
    """The parents of a module, root first."""
    by_name, chain = schema.by_name(), []
    parent = by_name[name].after
    while parent is not None:
        chain.insert(0, parent)
        parent = by_name[parent].after
    return chain


def compile_library(loaded: LoadedModel, schema: Schema, out: Path,
                    progress: Callable[[int, int], None] | None = None) -> CompileResult:
    tok = loaded.tokenizer
    if tok is None:
        raise CompileError(f"{loaded.reference} has no tokenizer (dummy weights); compile with a real model")
    start = time.perf_counter()
    sys_ids = shared_prefix_ids(tok, schema.system_text)
    tokens = module_tokens(tok, schema)
    pos, next_position = plan_positions(schema, tokens, len(sys_ids))
    limit = loaded.config.max_position_embeddings
    ends = {m.name: pos[m.name] + _width(*tokens[m.name]) for m in schema.modules}
    last = max([next_position or 0, *ends.values()])
    if last >= limit:
        raise CompileError(f"the schema {schema.name!r} reaches position {last}, the model's context is {limit}; "
                           "shorten its modules")
    total = len(sys_ids) + sum(len(tokens[m.name][0]) for m in schema.modules)
    done = 0

    def step(n: int) -> Callable[[int, int], None] | None:
        return None if progress is None else (lambda k, _total: progress(done + k, total))

    sys_kv = prefill_kv(loaded, sys_ids, progress=step(len(sys_ids)))
    done = len(sys_ids)
    kv: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    segments, row = [], len(sys_ids)
    for m in schema.modules:
        chain = _chain(schema, m.name)
        parts = [sys_kv] + [kv[p] for p in chain]
        context = ([torch.cat([p[0][i] for p in parts]) for i in range(len(sys_kv[0]))],
                   [torch.cat([p[1][i] for p in parts]) for i in range(len(sys_kv[0]))])
        head, rest = tokens[m.name]
        kv[m.name] = prefill_kv(loaded, head, progress=step(len(head)), context=context,
                                first_position=pos[m.name])
        done += len(head)
        segments.append({"name": m.name, "start": row, "end": row + len(head), "position": pos[m.name],
                         "after": ["system", *chain], "union": m.union, "token_ids": head, "rest": rest})
        row += len(head)
    layers = range(loaded.config.num_hidden_layers)
    keys = [torch.cat([sys_kv[0][i]] + [kv[m.name][0][i] for m in schema.modules]) for i in layers]
    values = [torch.cat([sys_kv[1][i]] + [kv[m.name][1][i] for m in schema.modules]) for i in layers]
    meta = artifact_meta(loaded, schema.system_text, sys_ids)
    meta["schema"] = {"name": schema.name, "mode": schema.mode, "next_position": next_position}
    nbytes = save_artifact(out, keys, values, meta, modules=segments)
    return CompileResult(Path(out), row, nbytes, time.perf_counter() - start)

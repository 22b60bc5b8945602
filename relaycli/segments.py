"""The `segments` list of a `.relaykv` artifact: which rows of its KV tensors hold what.

Format 1 holds one segment, the system prompt: {"name": "system", "start": 0, "end": S}.
Format 2 (a prompt-module library, relaycli.modules) holds the system segment, then one
segment per module, its rows following the previous one's:

    {"name", "start", "end",        # rows of the KV tensors
     "position",                    # the position of its first row (RoPE)
     "after",                       # what it was computed after: ["system", parents...]
     "union",                       # its union's index in the schema, or null
     "token_ids",                   # the ids of its rows
     "rest"}                        # what follows in a row's sequence, not cached:
                                    # [{"parameter": name, "len": n} | {"ids": [...]}, ...]

and the metadata holds "schema": {"name", "mode", "next_position"} (next_position: where a
row's own tokens start in an independent schema; null in an exact one, where they follow
the chosen modules). `segment_problem` says what is wrong with a list, or None.
"""

from __future__ import annotations

from relaycli.modules import MODES

_MODULE_KEYS = {"name", "start", "end", "position", "after", "union", "token_ids", "rest"}


def _int(x, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def system_segment(num_tokens: int, library: bool) -> dict:
    seg = {"name": "system", "start": 0, "end": num_tokens}
    return dict(seg, position=0, after=[]) if library else seg


def num_rows(meta: dict) -> int:
    """Rows of every KV tensor: the system prompt's tokens, then every module's."""
    segments = meta.get("segments")
    if meta.get("format_version") == 2 and isinstance(segments, list) and segments and isinstance(segments[-1], dict):
        end = segments[-1].get("end")
        if _int(end):
            return end
    return len(meta["token_ids"])


def _rest_problem(rest) -> str | None:
    if not isinstance(rest, list):
        return "its rest is not a list"
    names = set()
    for item in rest:
        if isinstance(item, dict) and set(item) == {"parameter", "len"}:
            if not isinstance(item["parameter"], str) or not _int(item["len"], 1) or item["parameter"] in names:
                return "a parameter in its rest is malformed"
            names.add(item["parameter"])
        elif not (isinstance(item, dict) and set(item) == {"ids"} and isinstance(item["ids"], list)
                  and all(_int(t) for t in item["ids"])):
            return "an item of its rest is neither a parameter nor token ids"
    if rest and not names:
        return "its rest holds no parameter"
    return None


def segment_problem(meta: dict) -> str | None:
    """What is wrong with a format-2 library's segments and schema (None: nothing)."""
    schema, segments, num = meta.get("schema"), meta.get("segments"), len(meta["token_ids"])
    if not (isinstance(schema, dict) and set(schema) == {"name", "mode", "next_position"}
            and isinstance(schema["name"], str) and schema["mode"] in MODES):
        return "metadata field schema is not {name, mode, next_position}"
    independent = schema["mode"] == "independent"
    nxt = schema["next_position"]
    if independent != _int(nxt, num) or (not independent and nxt is not None):
        return "metadata field schema.next_position does not fit its mode"
    if not isinstance(segments, list) or not segments or segments[0] != system_segment(num, True):
        return "metadata field segments does not start with the system segment"
    if len(segments) < 2:
        return "metadata field segments holds no module"
    seen: dict[str, dict] = {"system": segments[0]}
    for i, seg in enumerate(segments[1:], 1):
        if not isinstance(seg, dict) or set(seg) != _MODULE_KEYS:
            return f"segment {i} does not have the fields {sorted(_MODULE_KEYS)}"
        name = seg["name"]
        if not isinstance(name, str) or name in seen:
            return f"segment {i} has a missing or repeated name"
        prev = segments[i - 1]
        ids, start, end, pos = seg["token_ids"], seg["start"], seg["end"], seg["position"]
        if start != prev["end"] or not _int(end, start + 1):
            return f"segment {name!r} does not follow the rows of the one before it"
        if not isinstance(ids, list) or len(ids) != end - start or not all(_int(t) for t in ids):
            return f"segment {name!r} has token_ids that do not match its rows"
        after = seg["after"]
        if not (isinstance(after, list) and after and after[0] == "system" and all(a in seen for a in after)):
            return f"segment {name!r} is computed after segments that do not come before it"
        if seg["union"] is not None and not _int(seg["union"]):
            return f"segment {name!r} has a malformed union"
        if (problem := _rest_problem(seg["rest"])) is not None:
            return f"segment {name!r}: {problem}"
        if independent:
            if after != ["system"] or not _int(pos, num) or pos + (end - start) > nxt:
                return f"segment {name!r} has a position range outside the schema's"
        else:
            parent = seen[after[-1]]
            want_pos = parent["position"] + parent["end"] - parent["start"]
            if after != parent["after"] + [parent["name"]] or pos != want_pos or parent.get("rest"):
                return f"segment {name!r} is not placed right after its parent chain"
        seen[name] = seg
    return None

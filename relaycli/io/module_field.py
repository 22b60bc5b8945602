"""The `modules` field of a request row (prompt modules, docs/modules.md): checked for its
shape here; whether the modules exist and fit together is the library's to say."""

from __future__ import annotations

from typing import Any

from relaycli.io.values import is_text as _is_text, show as _show


def parse_modules(v: Any) -> list[dict]:
    """A row's modules as [{"name": ..., parameter: value}]; a bare string is a module name."""
    if not isinstance(v, list) or not v:
        raise ValueError(f"modules must be a non-empty list of module names or {{name, parameter: value}} "
                         f"objects, got {_show(v)}")
    out = []
    for i, item in enumerate(v):
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict):
            raise ValueError(f"modules[{i}] must be a module name or an object with 'name', got {_show(item)}")
        item = {k: x for k, x in item.items() if x is not None}  # Parquet structs bring nulls
        if not isinstance(item.get("name"), str) or not item["name"] or not _is_text(item["name"]):
            raise ValueError(f"modules[{i}] needs a 'name', the module's name; got {_show(item)}")
        for key, value in item.items():
            if not isinstance(key, str) or not _is_text(value) or (key != "name" and not isinstance(value, str)):
                raise ValueError(f"modules[{i}].{key} must be a string (a parameter's value), got {_show(value)}")
        out.append(item)
    return out

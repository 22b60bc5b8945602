"""The `modules` field of a request row (prompt modules, docs/modules.md), and Prompt
Cache's own prompt form, a PML `<prompt>` that names the modules inline: checked for
their shape here; whether the modules exist and fit together is the library's to say."""

from __future__ import annotations

import textwrap
from typing import Any
from xml.parsers import expat

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


def is_pml_prompt(text: str) -> bool:
    """A prompt written in Prompt Cache's form: one <prompt> element, nothing around it."""
    stripped = text.strip()
    return stripped.startswith("<prompt") and stripped.endswith("</prompt>")


def parse_pml_prompt(text: str) -> tuple[str | None, list[dict], str]:
    """(schema, modules, question) of a PML prompt: `<prompt schema="S">` holding module
    elements, each `<NAME/>` or `<module name="NAME"/>` whose other attributes fill the
    module's parameters, and free text, the row's own question (dedented, stripped; text
    between modules joins it). ValueError naming the fix when it is not that shape."""
    parser = expat.ParserCreate()
    depth, schema, modules, text_parts = 0, [None], [], []

    def start(tag: str, attrs: dict) -> None:
        nonlocal depth
        depth += 1
        where = f"at column {parser.CurrentColumnNumber + 1}"
        if depth == 1:
            if tag != "prompt" or set(attrs) - {"schema"}:
                raise ValueError(f"a PML prompt is one <prompt> element with at most a 'schema' attribute, got "
                                 f"<{tag}> {where}")
            schema[0] = attrs.get("schema")
        elif depth == 2:
            item = dict(attrs)
            if tag != "module":
                if "name" in item:
                    raise ValueError(f"<{tag}> {where} names its module twice (tag and 'name'); keep the tag")
                item["name"] = tag
            elif not item.get("name"):
                raise ValueError(f"<module> {where} needs name=\"...\"")
            modules.append(item)
        else:
            raise ValueError(f"<{tag}> {where} sits inside a module element; a module element holds nothing "
                             "(its text is in the library), give parameters as attributes")

    def end(_tag: str) -> None:
        nonlocal depth
        depth -= 1

    def chars(data: str) -> None:
        if depth == 1:
            text_parts.append(data)
        elif depth > 1 and data.strip():
            raise ValueError(f"text inside a module element at column {parser.CurrentColumnNumber + 1}; a module "
                             "element holds nothing, give parameters as attributes")

    def no_doctype(*_args) -> None:
        raise ValueError("a <!DOCTYPE> in the prompt; remove it")

    parser.StartElementHandler, parser.EndElementHandler = start, end
    parser.CharacterDataHandler, parser.StartDoctypeDeclHandler = chars, no_doctype
    try:
        parser.Parse(text.strip(), True)
    except expat.ExpatError as exc:
        raise ValueError(f"not well-formed PML ({expat.ErrorString(exc.code)} at column {exc.offset + 1}); write "
                         "& < > in text as &amp; &lt; &gt;") from None
    question = textwrap.dedent("".join(text_parts)).strip()
    if not modules:
        raise ValueError("the <prompt> names no module; name the modules it uses")
    if not question:
        raise ValueError("the <prompt> holds no question after its modules; add the row's own text")
    return schema[0], parse_modules(modules), question

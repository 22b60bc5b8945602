"""Prompt-module schemas (Prompt Cache's PML): which reusable prompt parts a library holds.

    <schema name="support" mode="exact">
      <system>You are the support assistant of ACME.</system>
      <module name="policy">Refunds need a receipt.</module>
      <module name="contract_17" after="policy">Contract 17 covers ...</module>
      <union>
        <module name="plan_basic" after="policy">Basic plan for <parameter name="days" len="4"/> days.</module>
        <module name="plan_pro" after="policy">Pro plan.</module>
      </union>
    </schema>

`mode="exact"` (the default): a module is computed after the system text and its `after`
chain, at the positions that follow them; a row whose modules form one root-to-node path
is answered exactly as the same token sequence sent whole. `mode="independent"` (Prompt
Cache's way): every module is computed after the system text alone, at a position range
the schema assigns in document order (the members of a union share one range); a row may
combine any modules, one of each union, and its answers differ from a full prefill.

A `<parameter name len/>` is filled by each row with at most `len` tokens; the value and
the rest of its module are computed with the row's own tokens, so a module with a
parameter comes last: a leaf of the tree (exact), in the schema's last place (independent).
Module text is dedented and stripped; a module's tokens are those of a newline followed
by its text, so modules start new lines of the user turn.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from xml.parsers import expat

from relaycli.errors import RelayError

MODES = ("exact", "independent")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_MARK = "\x00"  # stands for a parameter while the module text is dedented
MAX_PARAMETER_LEN = 4096


class SchemaError(RelayError):
    """A malformed schema: the message names the file, the line and the fix."""


@dataclass
class Parameter:
    name: str
    max_tokens: int


@dataclass
class Module:
    name: str
    line: int
    after: str | None = None  # exact mode: the parent module
    union: int | None = None  # index of its union in the schema, None when alone
    # text pieces and parameters in order: head text first, then Parameter, text, ...
    pieces: list = field(default_factory=list)

    @property
    def head(self) -> str:
        return self.pieces[0]

    @property
    def parameters(self) -> list[Parameter]:
        return [p for p in self.pieces if isinstance(p, Parameter)]


@dataclass
class Schema:
    name: str
    mode: str
    system_text: str
    modules: list[Module]  # in document order (the order of a row's token sequence)

    def by_name(self) -> dict[str, Module]:
        return {m.name: m for m in self.modules}


class _Builder:
    """Expat callbacks: a flat walk keeping the open elements and the text of each module."""

    def __init__(self, path: Path, parser) -> None:
        self.path, self.parser = path, parser
        self.stack: list[str] = []
        self.schema: dict | None = None
        self.system: list[str] | None = None
        self.system_line = 0
        self.modules: list[Module] = []
        self.current: Module | None = None
        self.text: list = []  # the current module's text and Parameter marks
        self.unions = 0
        self.union: int | None = None
        self.union_line = 0

    def fail(self, what: str, fix: str, line: int | None = None) -> SchemaError:
        return SchemaError(f"{self.path}, line {line or self.parser.CurrentLineNumber}: {what}; {fix}")

    def _name(self, attrs: dict, tag: str) -> str:
        name = attrs.get("name")
        if name is None:
            raise self.fail(f"<{tag}> has no name", f'write <{tag} name="...">')
        if not _NAME.fullmatch(name) or name == "system":
            raise self.fail(f"<{tag}> name {name!r} is not a name", "use letters, digits, _ . - (up to 64), "
                            "not 'system'")
        return name

    def _attrs(self, tag: str, attrs: dict, allowed: tuple[str, ...]) -> None:
        extra = sorted(set(attrs) - set(allowed))
        if extra:
            raise self.fail(f"<{tag}> has attribute {extra[0]!r}", f"<{tag}> takes {', '.join(allowed) or 'none'}")

    def start(self, tag: str, attrs: dict) -> None:
        parent = self.stack[-1] if self.stack else None
        where = {"schema": (None,), "system": ("schema",), "module": ("schema", "union"), "union": ("schema",),
                 "parameter": ("module",)}
        if tag not in where:
            raise self.fail(f"unknown element <{tag}>", "use <schema>, <system>, <module>, <union>, <parameter>")
        if parent not in where[tag]:
            inside = f"inside <{parent}>" if parent else "at the top"
            want = " or ".join(f"<{p}>" for p in where[tag] if p) or "the top of the file"
            raise self.fail(f"<{tag}> {inside}", f"put it in {want}")
        if tag == "schema":
            self._attrs(tag, attrs, ("name", "mode"))
            mode = attrs.get("mode", "exact")
            if mode not in MODES:
                raise self.fail(f'mode="{mode}"', f"use {' or '.join(MODES)}")
            self.schema = {"name": self._name(attrs, tag), "mode": mode}
        elif tag == "system":
            self._attrs(tag, attrs, ())
            if self.system is not None:
                raise self.fail("a second <system>", "keep one <system> element")
            self.system, self.system_line = [], self.parser.CurrentLineNumber
        elif tag == "union":
            self._attrs(tag, attrs, ())
            self.union, self.union_line = self.unions, self.parser.CurrentLineNumber
            self.unions += 1
        elif tag == "module":
            self._attrs(tag, attrs, ("name", "after"))
            after = attrs.get("after")
            if after is not None and self.schema["mode"] != "exact":
                raise self.fail(f"module {attrs.get('name')!r} has after= in an independent schema",
                                'remove after= or use mode="exact"')
            self.current = Module(self._name(attrs, tag), self.parser.CurrentLineNumber, after, self.union)
            self.text = []
        else:  # parameter
            self._attrs(tag, attrs, ("name", "len"))
            name = self._name(attrs, tag)
            raw = attrs.get("len", "")
            if not raw.isdigit() or not 1 <= int(raw) <= MAX_PARAMETER_LEN:
                raise self.fail(f"parameter {name!r} has len={raw!r}",
                                f"give len, the most tokens a value may have (1 to {MAX_PARAMETER_LEN})")
            if any(isinstance(p, Parameter) and p.name == name for p in self.text):
                raise self.fail(f"parameter {name!r} appears twice in module {self.current.name!r}",
                                "give each parameter of a module its own name")
            self.text.append(Parameter(name, int(raw)))
        self.stack.append(tag)

    def end(self, tag: str) -> None:
        self.stack.pop()
        if tag == "module":
            self.current.pieces = _pieces(self.text)
            if not self.current.head.strip() and len(self.current.pieces) == 1:
                raise self.fail(f"module {self.current.name!r} is empty", "write its text between the tags",
                                self.current.line)
            self.modules.append(self.current)
            self.current = None
        elif tag == "union":
            members = [m for m in self.modules if m.union == self.union]
            if len(members) < 2:
                raise self.fail("a <union> with fewer than two modules", "put two or more <module>s in it, or "
                                "remove the <union>", self.union_line)
            self.union = None

    def chars(self, data: str) -> None:
        where = self.stack[-1] if self.stack else None
        if where == "module":
            self.text.append(data)
        elif where == "system":
            self.system.append(data)
        elif data.strip():
            raise self.fail(f"text {data.strip()[:30]!r} directly inside <{where}>",
                            "put text in <system> or in a <module>")


def _pieces(raw: list) -> list:
    """Marks and text -> [head, Parameter, text, Parameter, text, ...] (texts may be empty),
    the whole dedented and stripped as one text."""
    joined = "".join(_MARK if isinstance(p, Parameter) else p for p in raw)
    params = [p for p in raw if isinstance(p, Parameter)]
    texts = textwrap.dedent(joined).strip().split(_MARK)
    out: list = [texts[0]]
    for param, text in zip(params, texts[1:]):
        out += [param, text]
    return out


def parse_schema(text: str, path: Path) -> Schema:
    """Parse PML; refuse anything malformed with the file, the line and the fix."""
    parser = expat.ParserCreate()
    b = _Builder(path, parser)

    def no_doctype(*_args) -> None:
        raise b.fail("a <!DOCTYPE> declaration", "remove it; a schema is plain elements")

    parser.StartElementHandler, parser.EndElementHandler = b.start, b.end
    parser.CharacterDataHandler, parser.StartDoctypeDeclHandler = b.chars, no_doctype
    try:
        parser.Parse(text, True)
    except expat.ExpatError as exc:
        raise SchemaError(f"{path}, line {exc.lineno}: not well-formed XML ({expat.ErrorString(exc.code)}); "
                          "close every tag and write & < > in text as &amp; &lt; &gt;") from None
    if b.schema is None:
        raise SchemaError(f"{path}: no <schema> element; write <schema name=\"...\"> around the modules")
    system = textwrap.dedent("".join(b.system or [])).strip()
    if not system:
        raise SchemaError(f"{path}, line {b.system_line or 1}: the schema has no system text; "
                          "write it in <system>...</system>")
    schema = Schema(b.schema["name"], b.schema["mode"], system, b.modules)
    _check_tree(schema, path)
    return schema


def _check_tree(schema: Schema, path: Path) -> None:
    """Unique names, parents defined above their children, parameters only where they come last."""
    seen: dict[str, Module] = {}
    children: dict[str, Module] = {}
    for m in schema.modules:
        if m.name in seen:
            raise SchemaError(f"{path}, line {m.line}: module {m.name!r} is defined twice (line "
                              f"{seen[m.name].line}); rename one")
        if m.after is not None:
            if m.after not in seen:
                raise SchemaError(f"{path}, line {m.line}: module {m.name!r} is after {m.after!r}, which is not "
                                  "defined above it; define the parent module first")
            children.setdefault(m.after, m)
        seen[m.name] = m
    for m in schema.modules:
        if not m.parameters:
            continue
        if schema.mode == "exact" and m.name in children:
            raise SchemaError(f"{path}, line {m.line}: module {m.name!r} has a parameter and module "
                              f"{children[m.name].name!r} is after it; only a leaf module may have parameters "
                              "(move the parameter into a leaf module)")
        last = schema.modules[-1]
        if schema.mode == "independent" and not (m is last or (m.union is not None and m.union == last.union)):
            raise SchemaError(f"{path}, line {m.line}: module {m.name!r} has a parameter but is not last in the "
                              "schema; in an independent schema move it (or its union) to the end")


def read_schema(path: Path) -> Schema:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SchemaError(f"{path}: cannot read it ({exc.strerror}); give a readable schema file") from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    return parse_schema(text, path)


def is_schema_file(path: Path) -> bool:
    """A schema is named *.pml, or is text that starts with a <schema element."""
    path = Path(path)
    if path.suffix.lower() == ".pml":
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(256).decode("utf-8", "ignore").removeprefix("\ufeff").lstrip()
    except OSError:
        return False
    return head.startswith("<schema") or (head.startswith(("<?xml", "<!--")) and "<schema" in head)

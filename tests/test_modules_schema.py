"""Prompt-module schemas (PML) and the `modules` field of a row: what parses, and every
refusal naming the line and the fix. No model is loaded here."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaycli.io.requests import ResultRow, parse_request
from relaycli.module_compile import plan_positions
from relaycli.modules import Parameter, SchemaError, is_schema_file, parse_schema, read_schema

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "support.pml"

GOOD = """<schema name="support">
  <system>
    You help customers.
  </system>
  <module name="policy">
    Refunds need a receipt.
      Indented line.
  </module>
  <module name="contract" after="policy">Contract 17.</module>
  <union>
    <module name="basic" after="policy">Basic plan for <parameter name="days" len="4"/> days.</module>
    <module name="pro" after="policy">Pro plan.</module>
  </union>
</schema>
"""


def _parse(text: str):
    return parse_schema(text, Path("s.pml"))


def test_a_schema_parses_into_modules_in_document_order():
    s = _parse(GOOD)
    assert (s.name, s.mode, s.system_text) == ("support", "exact", "You help customers.")
    assert [m.name for m in s.modules] == ["policy", "contract", "basic", "pro"]
    assert s.modules[0].pieces == ["Refunds need a receipt.\n  Indented line."]  # dedented, stripped
    assert [m.after for m in s.modules] == [None, "policy", "policy", "policy"]
    assert [m.union for m in s.modules] == [None, None, 0, 0]
    assert s.modules[2].pieces == ["Basic plan for ", Parameter("days", 4), " days."]
    assert [m.line for m in s.modules] == [5, 9, 11, 12]


def test_the_example_library_parses():
    s = read_schema(EXAMPLE)
    assert s.modules and is_schema_file(EXAMPLE)


def test_independent_positions_follow_document_order_and_unions_share_a_range():
    s = _parse('<schema name="x" mode="independent"><system>S</system><module name="a">A</module>'
               '<union><module name="b">B</module><module name="c">C</module></union>'
               '<module name="d">D <parameter name="p" len="5"/> end</module></schema>')
    tokens = {"a": ([1, 2], []), "b": ([1, 2, 3], []), "c": ([1], []),
              "d": ([1], [{"parameter": "p", "len": 5}, {"ids": [9, 9]}])}
    pos, end = plan_positions(s, tokens, 10)
    assert pos == {"a": 10, "b": 12, "c": 12, "d": 15} and end == 15 + 1 + 5 + 2


def test_exact_positions_follow_the_parent_chain():
    s = _parse(GOOD)
    tokens = {"policy": ([1] * 4, []), "contract": ([1] * 3, []), "basic": ([1] * 2, []), "pro": ([1], [])}
    pos, end = plan_positions(s, tokens, 10)
    assert pos == {"policy": 10, "contract": 14, "basic": 14, "pro": 14} and end is None


BAD = [
    ('<schema name="x"><system>S</system>\n<module name="a">A</module>\n<module name="a">B</module></schema>',
     "line 3: module 'a' is defined twice"),
    ('<schema name="x"><system>S</system>\n<module name="b" after="a">B</module></schema>',
     "line 2: module 'b' is after 'a', which is not defined above it"),
    ('<schema name="x" mode="independent"><system>S</system>\n<module name="b" after="a">B</module></schema>',
     "line 2: module 'b' has after= in an independent schema; remove after="),
    ('<schema name="x"><system>S</system>\n<module name="a">A <parameter name="p" len="3"/></module>\n'
     '<module name="b" after="a">B</module></schema>', "line 2: module 'a' has a parameter .* only a leaf"),
    ('<schema name="x" mode="independent"><system>S</system>\n<module name="a">A <parameter name="p" len="3"/>'
     '</module>\n<module name="b">B</module></schema>', "line 2: .* not last in the schema"),
    ('<schema name="x"><system>S</system>\n<module name="a">A <parameter name="p"/></module></schema>',
     "line 2: parameter 'p' has len=''; give len"),
    ('<schema name="x"><system>S</system>\n<module name="a">A</modul></schema>', "line 2: not well-formed XML"),
    ('<schema name="x"><system>S</system>\nloose text<module name="a">A</module></schema>',
     "line 2: text 'loose text' directly inside <schema>"),
    ('<schema name="x"><system>S</system>\n<union><module name="a">A</module></union></schema>',
     "line 2: a <union> with fewer than two modules"),
    ('<schema name="x">\n<module name="a">A</module></schema>', "the schema has no system text"),
    ('<schema name="x"><system>S</system>\n<module>A</module></schema>', "line 2: <module> has no name"),
    ('<schema name="x"><system>S</system>\n<module name="system">A</module></schema>', "not a name"),
    ('<schema name="x"><system>S</system>\n<module name="a"></module></schema>', "line 2: module 'a' is empty"),
    ('<schema name="x" mode="fast"><system>S</system></schema>', 'line 1: mode="fast"; use exact or independent'),
    ('<schema name="x"><system>S</system>\n<doc name="a">A</doc></schema>', "line 2: unknown element <doc>"),
    ('<schema name="x"><system>S</system>\n<module name="a" weight="2">A</module></schema>',
     "line 2: <module> has attribute 'weight'"),
    ('<!DOCTYPE x [<!ENTITY a "aaaa">]>\n<schema name="x"><system>&a;</system></schema>', "DOCTYPE"),
    ('<module name="a">A</module>', "line 1: <module> at the top"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_a_malformed_schema_is_refused_with_its_line_and_fix(text, message):
    with pytest.raises(SchemaError, match=message) as info:
        _parse(text)
    assert str(info.value).startswith("s.pml") and "\n" not in str(info.value)


def test_schema_files_are_told_apart_from_system_prompts(tmp_path):
    (tmp_path / "a.txt").write_text("  <schema name='x'>...")
    (tmp_path / "b.txt").write_text("You are a helpful assistant.")
    assert is_schema_file(tmp_path / "a.txt") and not is_schema_file(tmp_path / "b.txt")
    assert is_schema_file(tmp_path / "c.pml")
    with pytest.raises(SchemaError, match="cannot read it"):
        read_schema(tmp_path / "missing.pml")


def test_a_row_names_modules_as_names_or_objects_with_parameter_values():
    row = parse_request({"prompt": "q", "modules": ["policy", {"name": "basic", "days": "3"}], "schema": "support"}, 0)
    assert row.modules == [{"name": "policy"}, {"name": "basic", "days": "3"}] and row.schema == "support"


@pytest.mark.parametrize("raw,message", [
    ({"prompt": "q", "modules": "policy"}, "modules must be a non-empty list"),
    ({"prompt": "q", "modules": []}, "modules must be a non-empty list"),
    ({"prompt": "q", "modules": [{"days": "3"}]}, r"modules\[0\] needs a 'name'"),
    ({"prompt": "q", "modules": [{"name": "b", "days": 3}]}, r"modules\[0\].days must be a string"),
    ({"prompt": "q", "modules": [7]}, r"modules\[0\] must be a module name"),
    ({"prompt": "q", "modules": ["a"], "schema": ""}, "'schema' must be the name"),
    ({"prompt": "q", "schema": "s", "system_prompt": "t"}, "both 'schema' and 'system_prompt'"),
])
def test_a_malformed_modules_field_is_an_error_row(raw, message):
    got = parse_request(raw, 4)
    assert isinstance(got, ResultRow) and got.finish_reason == "error"
    assert got.error.startswith("row 4: ")
    import re
    assert re.search(message, got.error), got.error


# -- Prompt Cache's prompt form: <prompt schema="..."> with module elements and the question --

def test_a_pml_prompt_is_the_row_with_modules_schema_and_question():
    from relaycli.io.requests import RequestRow, parse_request
    pml = parse_request({"id": "a", "prompt": '\n<prompt schema="shop">\n  <policy/>\n  <module name="basic" '
                                              'months="6"/>\n  Can I phone\n  you?\n</prompt>\n'}, 0)
    plain = parse_request({"id": "a", "prompt": "Can I phone\nyou?", "schema": "shop",
                           "modules": ["policy", {"name": "basic", "months": "6"}]}, 0)
    assert isinstance(pml, RequestRow) and pml == plain
    same = parse_request({"prompt": "<prompt><policy/>q &amp; a</prompt>", "schema": "shop"}, 1)
    assert (same.schema, same.modules, same.messages[-1]["content"]) == ("shop", [{"name": "policy"}], "q & a")
    line = parse_request({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                          "body": {"prompt": "<prompt><policy/>q</prompt>", "schema": "shop"}}, 4)
    assert (line.schema, line.modules, line.messages[-1]["content"]) == ("shop", [{"name": "policy"}], "q")
    literal = parse_request({"prompt": "What does <prompt> mean in XML?"}, 2)  # not one <prompt> element
    assert literal.modules is None and literal.messages[-1]["content"] == "What does <prompt> mean in XML?"


@pytest.mark.parametrize("prompt,extra,message", [
    ("<prompt>q</prompt>", {}, "names no module"),
    ("<prompt><policy/></prompt>", {}, "holds no question after its modules"),
    ("<prompt><policy>text</policy>q</prompt>", {}, "text inside a module element at column 17"),
    ("<prompt><policy><x/></policy>q</prompt>", {}, "<x> at column 17 sits inside a module element"),
    ('<prompt lang="en"><policy/>q</prompt>', {}, "at most a 'schema' attribute"),
    ('<prompt><policy name="p"/>q</prompt>', {}, "names its module twice"),
    ("<prompt><module/>q</prompt>", {}, '<module> at column 9 needs name="..."'),
    ("<prompt><policy/>q & a</prompt>", {}, "not well-formed PML"),
    ("<prompt><policy/>q</prompt>", {"modules": ["policy"]}, "both in its PML 'prompt' and in 'modules'"),
    ('<prompt schema="a"><policy/>q</prompt>', {"schema": "b"}, "its PML prompt says schema='a'"),
])
def test_a_malformed_pml_prompt_is_an_error_row_naming_the_fix(prompt, extra, message):
    from relaycli.io.requests import ResultRow, parse_request
    row = parse_request({"id": "r", "prompt": prompt, **extra}, 3, line=4)
    assert isinstance(row, ResultRow) and row.error.startswith('row 3 (line 4, id "r"): ') and message in row.error, \
        row.error

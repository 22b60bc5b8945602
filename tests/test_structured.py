"""Constrained answers on the default model, greedy: JSON schemas, json_object, regex,
choices and grammars hold; relay and --no-relay give the same answers; a bad constraint
is an error row naming its field while the job goes on; without xgrammar a constrained
row is an error row naming the fix."""

from __future__ import annotations

import json
import re
import sys

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from relaycli.compile import compile_prompt, load_checked  # noqa: E402
from relaycli.config import EngineConfig  # noqa: E402
from relaycli.engine.engine import Engine  # noqa: E402
from relaycli.io.requests import RequestDefaults, ResultRow, parse_request  # noqa: E402

pytestmark = pytest.mark.slow
SYSTEM = "You are a precise assistant. Answer exactly in the requested format."

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                      "sure": {"type": "boolean"}}, "required": ["colour", "sure"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     "required": ["items"], "additionalProperties": False},
]
CHOICES = [["positive", "negative", "neutral"], ["yes", "no"], ["billing", "bug report", "feature request"]]
REGEXES = [r"\d{4}-\d{2}-\d{2}", r"(red|green|blue), (small|large)", r"[A-Z][a-z]{2,8}"]


def _rows():
    rows = []
    for i, schema in enumerate(SCHEMAS):
        rows.append({"id": f"schema{i}", "prompt": f"Describe item {i} as JSON.", "json_schema": schema,
                     "max_tokens": 48, "system_prompt": "sys"})
    rows.append({"custom_id": "openai-schema", "body": {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A person as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True,
                                                                   "schema": SCHEMAS[0]}}, "max_tokens": 48}})
    rows.append({"custom_id": "openai-object", "body": {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "A cat as a JSON object."}],
        "response_format": {"type": "json_object"}, "max_tokens": 48}})
    for i, choices in enumerate(CHOICES):
        rows.append({"id": f"choice{i}", "prompt": f"Classify: 'The app crashes when I pay.' Options: {choices}",
                     "choices": choices, "max_tokens": 8, "system_prompt": "sys", "logprobs": True,
                     "top_logprobs": 3})
    for i, pattern in enumerate(REGEXES):
        rows.append({"id": f"regex{i}", "prompt": "Answer in the required format.", "regex": pattern,
                     "max_tokens": 16, "system_prompt": "sys"})
    rows.append({"id": "grammar", "prompt": "Say hi or bye.", "grammar": 'root ::= ("hi" | "bye") " there"',
                 "max_tokens": 8, "system_prompt": "sys"})
    rows.append({"id": "cut", "prompt": "A person as JSON.", "json_schema": SCHEMAS[0], "max_tokens": 3,
                 "system_prompt": "sys"})
    rows.append({"id": "plain", "prompt": "Say hello.", "max_tokens": 4, "system_prompt": "sys"})
    return rows


@pytest.fixture(scope="module")
def artifact(default_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("structured") / "sys.relaykv"
    compile_prompt(default_model, SYSTEM, path)
    return load_checked(path, default_model)


def _run(default_model, artifact, raws, relay=True, overlap_steps=True):
    engine = Engine(default_model, [artifact], EngineConfig(max_num_seqs=8, relay=relay, overlap_steps=overlap_steps))
    rows = [parse_request(r, i, RequestDefaults(temperature=0)) for i, r in enumerate(raws)]
    return {r.id: r for r in engine.generate(rows)}


@pytest.fixture(scope="module")
def answers(default_model, artifact):
    return _run(default_model, artifact, _rows())


def test_json_schema_rows_that_stop_parse_and_validate(answers):
    stopped = 0
    for i, schema in enumerate(SCHEMAS):
        for key in [f"schema{i}"] + (["openai-schema"] if i == 0 else []):
            r = answers[key]
            assert r.finish_reason in ("stop", "length"), r.error
            if r.finish_reason == "stop":
                jsonschema.validate(json.loads(r.text), schema)
                stopped += 1
    assert stopped >= 3
    obj = answers["openai-object"]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    # JSON stays on one line (no indentation to pay tokens for), json_object's included
    for key in [f"schema{i}" for i in range(len(SCHEMAS))] + ["openai-schema", "openai-object", "cut"]:
        assert answers[key].text.startswith("{") and "\n" not in answers[key].text, (key, answers[key].text)


def test_choices_regex_and_grammar_rows_hold(answers):
    for i, choices in enumerate(CHOICES):
        r = answers[f"choice{i}"]
        assert r.finish_reason == "stop" and r.text in choices, (r.text, r.error)
        # logprobs under the mask: the alternatives are first tokens of the choices only
        top = r.logprobs[0]["top_logprobs"]
        assert top and all(any(c.startswith(t["token"]) for c in choices) for t in top), top
        assert sum(2.718281828 ** t["logprob"] for t in top) <= 1 + 1e-5
        assert sum(1 for _ in r.logprobs) == r.completion_tokens - 1  # the EOS token is no part of the answer
    for i, pattern in enumerate(REGEXES):
        r = answers[f"regex{i}"]
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), (r.text, r.error)
    assert answers["grammar"].text in ("hi there", "bye there")
    assert answers["cut"].finish_reason == "length" and answers["cut"].completion_tokens == 3
    assert answers["plain"].finish_reason in ("stop", "length") and answers["plain"].error is None


def test_relay_and_no_relay_answer_constrained_rows_alike(default_model, artifact, answers):
    baseline = _run(default_model, artifact, _rows(), relay=False)
    for key, r in answers.items():
        assert (baseline[key].text, baseline[key].finish_reason) == (r.text, r.finish_reason), key


def test_masks_made_while_the_next_step_computes_give_the_waited_answers(default_model, artifact, answers):
    # with overlapped steps a row's matcher takes its token between the next step's
    # forward and that step's masks, and a row whose grammar ended meanwhile is left
    # unmasked in its spare step; waiting for every step must answer the same
    waited = _run(default_model, artifact, _rows(), overlap_steps=False)
    for key, r in answers.items():
        assert (waited[key].text, waited[key].finish_reason, waited[key].completion_tokens) == \
            (r.text, r.finish_reason, r.completion_tokens), key


def test_bad_constraints_are_error_rows_and_the_job_goes_on(default_model, artifact):
    raws = [{"id": "re", "prompt": "x", "regex": "(("},
            {"id": "schema", "prompt": "x", "json_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}},
            {"id": "grammar", "prompt": "x", "grammar": "start ::= 'a'"},
            {"id": "grammar2", "prompt": "x", "grammar": "root ::= ("},
            {"id": "again", "prompt": "y", "regex": "(("},  # the cached failure, said again
            {"id": "ok", "prompt": "Say yes.", "choices": ["yes"], "max_tokens": 4}]
    got = _run(default_model, artifact, raws)
    for key, field in (("re", "'regex'"), ("schema", "'json_schema'"), ("grammar", "'grammar'"),
                       ("grammar2", "'grammar'"), ("again", "'regex'")):
        r = got[key]
        assert r.finish_reason == "error" and field in r.error and "fix it or remove the field" in r.error, r.error
        assert r.error.startswith("row ") and "\n" not in r.error
    assert got["ok"].text == "yes" and got["ok"].finish_reason == "stop"


def test_without_xgrammar_a_constrained_row_names_the_fix(default_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    engine = Engine(default_model, [], EngineConfig(max_num_seqs=4))
    d = RequestDefaults(temperature=0, max_tokens=2)
    rows = [parse_request({"prompt": "x", "choices": ["a", "b"]}, 0, d), parse_request({"prompt": "hi"}, 1, d)]
    got = {r.row_index: r for r in engine.generate(rows)}
    assert got[0].finish_reason == "error" and "pip install 'relay-batch[structured]'" in got[0].error
    assert got[1].finish_reason == "length" and isinstance(got[1], ResultRow)


def test_a_grammar_ends_its_row_also_with_ignore_eos(default_model, artifact):
    got = _run(default_model, artifact, [{"id": "a", "prompt": "Say yes.", "choices": ["yes", "no"],
                                          "ignore_eos": True, "max_tokens": 6}])
    assert got["a"].finish_reason == "stop" and got["a"].text in ("yes", "no")


def test_the_first_rows_grammars_are_compiled_ahead_and_a_bad_one_stays_an_error_row(default_model, tmp_path):
    from relaycli.io.reader import open_requests
    from relaycli.job import _first_constraints

    rows = [{"prompt": "a"}, {"prompt": "b", "regex": "[ab]+"}, {"prompt": "c", "regex": "[ab]+"},
            {"prompt": "d", "regex": "(("}, {"prompt": "e", "choices": ["x", "y"]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = _first_constraints(open_requests(path, None), RequestDefaults(), frozenset())
    assert sorted(s.field for s in specs) == ["choices", "regex", "regex"]  # one per distinct constraint
    engine = Engine(default_model, [], EngineConfig(max_num_seqs=4))
    engine.grammars.prepare_in_background(specs).join()
    assert len(engine.grammars._compiled) == 2 and len(engine.grammars._errors) == 1
    got = {r.row_index: r for r in engine.generate(
        [parse_request(r, i, RequestDefaults(temperature=0, max_tokens=3)) for i, r in enumerate(rows)])}
    assert got[3].finish_reason == "error" and "'regex'" in got[3].error
    assert re.fullmatch("[ab]+", got[1].text) and got[4].text in ("x", "y")

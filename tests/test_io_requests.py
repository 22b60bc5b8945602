"""parse_request: valid rows become RequestRows, every kind of bad row one clear error row."""

import pytest

from relaycli.io.requests import (RequestDefaults, RequestRow, ResultRow, SamplingParams, derive_seed,
                                  parse_request)

D = RequestDefaults()


def ok(raw, row_index=0, defaults=D) -> RequestRow:
    row = parse_request(raw, row_index, defaults)
    assert isinstance(row, RequestRow), row
    return row


def bad(raw, *needles, row_index=7) -> ResultRow:
    row = parse_request(raw, row_index, D)
    assert isinstance(row, ResultRow), row
    assert row.finish_reason == "error" and row.text == "" and row.row_index == row_index
    # the row's own id, where it has a usable one, names it too
    label = f"row {row_index}" if row.id == str(row_index) else f'row {row_index} (id "{row.id}")'
    assert row.error.startswith(f"{label}: ") and "\n" not in row.error
    for needle in needles:
        assert needle in row.error, (needle, row.error)
    return row


def test_prompt_row_gets_defaults_and_row_number_id():
    row = ok({"prompt": "What is 2+2?"}, row_index=12)
    assert row.id == "12"
    assert row.messages == [{"role": "user", "content": "What is 2+2?"}]
    s = row.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop, s.ignore_eos) == (256, 1.0, 1.0, None, [], False)
    assert s.seed == derive_seed(0, 12)
    assert not row.is_openai and row.url is None and row.system_prompt is None


def test_messages_row_with_sampling_fields():
    raw = {"id": "q1", "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello!"},
                                    {"role": "user", "content": "Bye", "name": "ignored"}],
           "max_tokens": 32, "temperature": 0, "top_p": 0.9, "top_k": 40, "seed": 5, "stop": "\n\n",
           "ignore_eos": True, "unknown_field": [1, 2]}
    row = ok(raw)
    assert row.id == "q1" and len(row.messages) == 4
    assert row.messages[3] == {"role": "user", "content": "Bye"}
    s = row.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos) == \
        (32, 0.0, 0.9, 40, 5, ["\n\n"], True)
    assert isinstance(s.temperature, float)


def test_defaults_apply_and_nulls_mean_absent():
    d = RequestDefaults(max_tokens=64, temperature=0.0, top_p=0.5, top_k=3, seed_base=99)
    row = ok({"prompt": "x", "max_tokens": None, "temperature": None, "stop": None, "id": None}, 4, d)
    s = row.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (64, 0.0, 0.5, 3, derive_seed(99, 4))
    assert row.id == "4"


def test_seeds_deterministic_distinct_and_in_range():
    seeds = [derive_seed(0, i) for i in range(1000)]
    assert seeds == [derive_seed(0, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(1, 0) != derive_seed(0, 0)
    assert derive_seed(0, 3) == 6616413020432831626  # fixed forever: changing it changes every job's output


def test_integral_floats_and_int_ids_accepted():
    row = ok({"id": 17, "prompt": "x", "max_tokens": 64.0, "seed": 3.0})
    assert row.id == "17" and row.sampling.max_tokens == 64 and row.sampling.seed == 3


def test_content_parts_joined():
    row = ok({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b"}]}]})
    assert row.messages[0]["content"] == "ab"


def test_system_prompt_names_artifact():
    assert ok({"prompt": "x", "system_prompt": "support"}).system_prompt == "support"


def test_openai_chat_line():
    raw = {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}],
                    "max_completion_tokens": 20, "temperature": 0.2, "stop": ["END"]}}
    row = ok(raw)
    assert row.is_openai and row.id == "req-1" and row.url == "/v1/chat/completions"
    assert (row.sampling.max_tokens, row.sampling.temperature, row.sampling.stop) == (20, 0.2, ["END"])


def test_openai_completion_line_and_top_level_sampling():
    raw = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "seed": 11,
           "body": {"prompt": "Once upon", "max_tokens": 8}}
    row = ok(raw)
    assert row.url == "/v1/completions" and row.messages == [{"role": "user", "content": "Once upon"}]
    assert row.sampling.seed == 11 and row.sampling.max_tokens == 8


def test_openai_body_overrides_top_level_and_url_inferred():
    row = ok({"custom_id": "c", "temperature": 0.1, "body": {"prompt": "x", "temperature": 0.7}})
    assert row.sampling.temperature == 0.7 and row.url == "/v1/completions"


@pytest.mark.parametrize("raw, needles", [
    (None, ["empty", "JSON object"]),
    ([1, 2], ["a list", "not an object"]),
    ("text", ["a str"]),
    ({}, ["'prompt'", "'messages'", "add one"]),
    ({"id": "a"}, ["needs a 'prompt'"]),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, ["both 'prompt' and 'messages'"]),
    ({"prompt": 5}, ["'prompt' must be a string"]),
    ({"prompt": ["a"]}, ["'prompt' must be a string"]),
    ({"prompt": "   "}, ["'prompt' is empty"]),
    ({"messages": []}, ["non-empty list"]),
    ({"messages": "hi"}, ["non-empty list"]),
    ({"messages": ["hi"]}, ["messages[0] must be an object"]),
    ({"messages": [{"role": "bot", "content": "x"}]}, ["messages[0].role", "system, user, assistant", "'bot'"]),
    ({"messages": [{"role": ["user"], "content": "x"}]}, ["messages[0].role"]),
    ({"messages": [{"content": "x"}]}, ["messages[0].role"]),
    ({"messages": [{"role": "user", "content": "ok"}, {"role": "user"}]}, ["messages[1].content must be a string"]),
    ({"messages": [{"role": "user", "content": 3}]}, ["messages[0].content must be a string"]),
    ({"messages": [{"role": "user", "content": ""}]}, ["messages[0].content is empty"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["text only"]),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
     ["messages[1] is a system message"]),
    ({"messages": [{"role": "system", "content": "a"}]}, ["only a system message"]),
    ({"prompt": "x", "system_prompt": 3}, ["'system_prompt'"]),
    ({"prompt": "x", "system_prompt": ""}, ["'system_prompt'"]),
    ({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}], "system_prompt": "s"},
     ["both 'system_prompt' and a system message"]),
    ({"prompt": "x", "id": 1.5}, ["'id' must be a non-empty string"]),
    ({"prompt": "x", "id": ""}, ["'id' must be a non-empty string"]),
    ({"prompt": "x", "temperature": -0.1}, ["'temperature' must be a number >= 0", "default"]),
    ({"prompt": "x", "temperature": "hot"}, ["'temperature' must be a finite number"]),
    ({"prompt": "x", "temperature": float("nan")}, ["'temperature' must be a finite number"]),
    ({"prompt": "x", "temperature": True}, ["'temperature' must be a finite number"]),
    ({"prompt": "x", "top_p": 0}, ["'top_p' must be a number in (0, 1]"]),
    ({"prompt": "x", "top_p": 1.5}, ["'top_p' must be a number in (0, 1]"]),
    ({"prompt": "x", "top_k": 0}, ["'top_k' must be an integer >= 1"]),
    ({"prompt": "x", "top_k": -1}, ["'top_k' must be an integer >= 1"]),
    ({"prompt": "x", "top_k": 2.5}, ["'top_k' must be an integer"]),
    ({"prompt": "x", "max_tokens": 0}, ["'max_tokens' must be an integer >= 1"]),
    ({"prompt": "x", "max_tokens": "10"}, ["'max_tokens' must be an integer"]),
    ({"prompt": "x", "max_tokens": True}, ["'max_tokens' must be an integer"]),
    ({"prompt": "x", "max_tokens": 5, "max_completion_tokens": 6}, ["disagree"]),
    ({"prompt": "x", "seed": -1}, ["'seed' must be an integer from 0"]),
    ({"prompt": "x", "seed": 2**63}, ["'seed' must be an integer from 0"]),
    ({"prompt": "x", "stop": 3}, ["'stop' must be a string or a list of strings"]),
    ({"prompt": "x", "stop": ["a", 1]}, ["'stop' must be a string or a list of strings"]),
    ({"prompt": "x", "stop": [""]}, ["'stop' holds an empty string"]),
    ({"prompt": "x", "ignore_eos": "yes"}, ["'ignore_eos' must be true or false"]),
    ({"custom_id": "c", "body": "x"}, ["'body' must be an object"]),
    ({"custom_id": "c", "body": {"messages": []}}, ["non-empty list"]),
    ({"custom_id": "c", "method": "GET", "body": {"prompt": "x"}}, ["'method' must be \"POST\""]),
    ({"custom_id": "c", "url": "/v1/embeddings", "body": {"prompt": "x"}}, ["'url' must be /v1/chat/completions"]),
    ({"custom_id": "c", "url": "/v1/chat/completions", "body": {"prompt": "x"}}, ["use url /v1/completions"]),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
     ["use url /v1/chat/completions"]),
    ({"custom_id": 3.5, "body": {"prompt": "x"}}, ["'custom_id' must be a non-empty string"]),
    ({"prompt": "x", "max_tokens": "64"}, ["'max_tokens' must be an integer", "leave the field out"]),
    # JSON's "\ud800" escape is a lone surrogate: no tokenizer or writer takes it.
    ({"prompt": "a\ud800b"}, ["'prompt' holds a lone surrogate", "fix that escape"]),
    ({"messages": [{"role": "user", "content": "\udfff"}]}, ["messages[0].content holds a lone surrogate"]),
    ({"prompt": "x", "id": "a\ud800"}, ["'id' holds a lone surrogate"]),
    ({"prompt": "x", "stop": ["\ud800"]}, ["'stop' holds a lone surrogate"]),
    ({"prompt": "x", "system_prompt": "\ud800"}, ["'system_prompt' must be the name"]),
    ({"custom_id": "c", "body": {"prompt": "x", "n": 17}}, ["'n' must be an integer from 1 to 16", "lower it"]),
    ({"custom_id": "c", "body": {"prompt": "x", "n": True}}, ["'n' must be an integer from 1 to 16"]),
    ({"prompt": "x", "n": 0}, ["'n' must be an integer from 1 to 16", "set it from 1 to 16"]),
    ({"prompt": "x", "presence_penalty": 0.5}, ["'presence_penalty' = 0.5 is not supported"]),
    ({"prompt": "x", "logprobs": "yes"}, ["'logprobs' must be true, false or an integer from 0 to 20"]),
    ({"prompt": "x", "logprobs": 21}, ["'logprobs' must be true, false or an integer from 0 to 20"]),
    ({"prompt": "x", "logprobs": True, "top_logprobs": 21}, ["'top_logprobs' must be an integer from 0 to 20"]),
    ({"prompt": "x", "logprobs": True, "top_logprobs": -1}, ["'top_logprobs' must be an integer from 0 to 20"]),
    ({"prompt": "x", "top_logprobs": 3}, ["'top_logprobs' needs 'logprobs': true"]),
    ({"prompt": "x", "logprobs": 2, "top_logprobs": 3}, ["'logprobs' and 'top_logprobs' disagree"]),
    ({"prompt": "x", "logit_bias": {"5": 100}}, ["'logit_bias'"]),
    ({"prompt": "x", "response_format": {"type": "xml"}}, ["'response_format.type' must be text, json_object"]),
    ({"prompt": "x", "response_format": "json"}, ["'response_format' must be an object with a 'type'"]),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, ["'response_format.json_schema' must be an object"]),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     ["'response_format.json_schema.schema' must be a JSON schema"]),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "y"}}},
     ["'response_format.json_schema.strict' must be true or false"]),
    ({"prompt": "x", "json_schema": "{not json"}, ["'json_schema' is a string but not JSON"]),
    ({"prompt": "x", "json_schema": [1]}, ["'json_schema' must be a JSON schema"]),
    ({"prompt": "x", "regex": ""}, ["'regex' must be a non-empty string holding a regular expression"]),
    ({"prompt": "x", "grammar": 5}, ["'grammar' must be a non-empty string holding an EBNF grammar"]),
    ({"prompt": "x", "choices": []}, ["'choices' must be a non-empty list of non-empty strings"]),
    ({"prompt": "x", "choices": ["a", ""]}, ["'choices' must be a non-empty list of non-empty strings"]),
    ({"prompt": "x", "choices": ["a"], "regex": "a"}, ["has 'regex' and 'choices'; keep one constraint"]),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}]},
     ["messages[1] is a system message"]),
])
def test_bad_rows_become_error_rows(raw, needles):
    bad(raw, *needles)


def test_neutral_values_of_unimplemented_fields_and_developer_role_accepted():
    row = ok({"custom_id": "c", "body": {"messages": [{"role": "developer", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}],
                                         "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "logprobs": False,
                                         "response_format": {"type": "text"}}})
    assert row.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert row.sampling.n == 1 and row.sampling.logprobs is None and row.constraint is None


def test_structured_fields_are_read():
    row = ok({"custom_id": "c", "body": {"messages": [{"role": "user", "content": "Hi"}], "n": 3, "logprobs": True,
                                         "top_logprobs": 4, "response_format": {
                                             "type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                                    "schema": {"type": "object"}}}}})
    assert (row.sampling.n, row.sampling.logprobs) == (3, 4)
    assert (row.constraint.kind, row.constraint.source, row.constraint.field) == (
        "json_schema", {"type": "object"}, "response_format")
    assert row.constraint.strict
    # a schema without `strict` is kept strictly, as relay's own `json_schema` field is
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert ok({"prompt": "x", "response_format": rf}).constraint.strict
    rf["json_schema"]["strict"] = False
    assert not ok({"prompt": "x", "response_format": rf}).constraint.strict
    assert ok({"prompt": "x", "logprobs": True}).sampling.logprobs == 0
    assert ok({"prompt": "x", "logprobs": 0}).sampling.logprobs == 0  # the completions endpoint's form
    assert ok({"prompt": "x", "response_format": {"type": "json_object"}}).constraint.kind == "json_object"
    assert ok({"prompt": "x", "json_schema": '{"type": "string"}'}).constraint.source == {"type": "string"}
    choices = ok({"prompt": "x", "choices": ["a", "b", "a"]}).constraint
    assert (choices.kind, choices.source) == ("choices", ["a", "b"])
    assert ok({"prompt": "x", "regex": "[0-9]+"}).constraint.kind == "regex"
    assert ok({"prompt": "x", "grammar": 'root ::= "a"'}).constraint.kind == "grammar"


def test_error_row_with_a_surrogate_id_carries_the_row_number():
    # The id cannot be written to any file, so the error row must not carry it.
    assert bad({"id": "\ud800", "prompt": ""}).id == "7"
    assert bad({"custom_id": "\ud800", "body": {"prompt": ""}}).id == "7"
    bad({"id": "\ud800", "prompt": ""}).error.encode("utf-8")


def test_error_row_keeps_usable_id_and_openai_url():
    assert bad({"id": "keep-me", "prompt": ""}).id == "keep-me"
    assert bad({"id": {"x": 1}, "prompt": 2}).id == "7"
    r = bad({"custom_id": "c9", "url": "/v1/completions", "body": {"prompt": ""}})
    assert r.id == "c9" and r.url == "/v1/completions"


def test_job_seed_base_has_the_range_of_a_row_seed():
    # Wider values would fold onto it: --seed -1 and --seed 2**64-1 gave the same job.
    for bad in (-1, 2**63, 2**64 - 1):
        with pytest.raises(ValueError, match="--seed must be an integer from 0 to 2\\*\\*63-1"):
            RequestDefaults(seed_base=bad)
    assert RequestDefaults(seed_base=2**63 - 1).seed_base == 2**63 - 1


def test_dataclass_validation():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="x")
    with pytest.raises(ValueError, match="temperature"):
        RequestDefaults(temperature=-1)
    with pytest.raises(ValueError, match="--seed must be an integer"):
        RequestDefaults(seed_base="0")
    with pytest.raises(ValueError, match="finish_reason"):
        ResultRow(0, "a", "t", "eos")
    with pytest.raises(ValueError, match="error must be"):
        ResultRow(0, "a", "", "error")
    with pytest.raises(ValueError, match="error must be"):
        ResultRow(0, "a", "t", "stop", error="oops")
    with pytest.raises(ValueError, match="cached_tokens"):
        ResultRow(0, "a", "t", "stop", prompt_tokens=3, cached_tokens=4)
    with pytest.raises(ValueError, match="messages"):
        RequestRow(0, "a", [])
    with pytest.raises(ValueError, match="url"):
        RequestRow(0, "a", [{"role": "user", "content": "x"}], url="/v1/embeddings")
    assert ResultRow.failed(1, "b", "row 1: boom").error == "row 1: boom"

"""Structured outputs and tools with the real ``openai`` client against ``quickdraft serve``
(SmolLM2-135M, float32): greedy output is the same with speculation (ngram) and without, streaming
and not; it parses and validates; tool calls come back as OpenAI's tool_calls."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from qd_server import API_KEY, MODEL

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "population": {"type": "integer", "minimum": 0},
                                           "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                         "maxItems": 2}},
          "required": ["city", "population", "landmarks"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _spec(usage) -> dict:
    return usage.model_extra["speculative"]


def test_json_schema_same_with_and_without_speculation(client, plain_client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format=FORMAT)
    spec, plain = client.chat.completions.create(**kw), plain_client.chat.completions.create(**kw)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    jsonschema.validate(json.loads(spec.choices[0].message.content), SCHEMA)
    assert spec.choices[0].finish_reason == "stop"  # the grammar completed
    # the schema's keys and punctuation are drafted from the grammar, with speculation off too
    assert _spec(plain.usage)["mean_accepted_length"] > 1.2 and _spec(spec.usage)["mean_accepted_length"] > 1.2
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == spec.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_sampling(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=3, n=2,
                                       response_format=FORMAT)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_structured_outputs_extension_on_completions(client, plain_client):
    prompt = "The date of the first moon landing, as YYYY-MM-DD:"
    for body, check in [({"regex": r"\d{4}-\d{2}-\d{2}"}, lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t)),
                        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                        ({"grammar": 'root ::= "19" [0-9] [0-9] "-0" [1-9]'}, lambda t: re.fullmatch(r"19\d\d-0[1-9]", t)),
                        ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)]:
        kw = dict(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, extra_body={"structured_outputs": body})
        a, b = client.completions.create(**kw), plain_client.completions.create(**kw)
        assert a.choices[0].text == b.choices[0].text and check(a.choices[0].text), (body, a.choices[0].text)
        assert a.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
        assert streamed == a.choices[0].text


def test_a_bad_schema_is_a_400_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 3}}}}})
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"structured_outputs": {"regex": "[a-"}})
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].text is not None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(client, plain_client, choice):
    msgs = [{"role": "user", "content": "What is the weather like in Paris?"}]
    kw = dict(model=MODEL, messages=msgs, tools=[ADD, WEATHER], tool_choice=choice, max_tokens=60, temperature=0)
    r, p = client.chat.completions.create(**kw), plain_client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("add", "get_weather") if choice == "required" else call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, {"add": ADD, "get_weather": WEATHER}[call.function.name]["function"]["parameters"])
    assert [(t.function.name, t.function.arguments) for t in p.choices[0].message.tool_calls] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == \
        [(i, t.function.name, t.function.arguments) for i, t in enumerate(c.message.tool_calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).strip()


def test_tool_choice_none_and_a_tool_reply(client):
    msgs = [{"role": "user", "content": "What is the weather like in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def qwen_client(request, qwen05_path):
    """Qwen2.5-Coder-0.5B, whose own chat template renders the tools and whose vocabulary has
    <tool_call> as a token (the grammar asks for that token)."""
    from qd_server import ServerProcess

    server = ServerProcess("--model", QWEN, "--dtype", "bfloat16", "--max-num-seqs", "1", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}', log_name="qwen")
    request.addfinalizer(server.stop)
    server.wait_ready(timeout=600)
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_qwen_template_tools(qwen_client):
    msgs = [{"role": "user", "content": "What is the weather like in Paris, in celsius?"}]
    for choice in ("auto", {"type": "function", "function": {"name": "get_weather"}}):
        r = qwen_client.chat.completions.create(model=QWEN, messages=msgs, tools=[ADD, WEATHER], tool_choice=choice,
                                                max_tokens=48, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather", (choice, c)
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])

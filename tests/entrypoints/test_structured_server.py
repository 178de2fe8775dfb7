"""Structured outputs and tool calls over HTTP with the official `openai` client (SmolLM2):
sampled JSON validates against its schema (`jsonschema`), regex and choice outputs match,
forced tool calls carry valid arguments, streamed calls reassemble to the whole one."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from jaxserve.bench.structured import NESTED
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, ServerThread
from tests.structured import SCHEMA

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
        "required": ["zone"], "additionalProperties": False}}}
EOS = 2  # SmolLM2's <|im_end|>
ASK = [{"role": "user", "content": "Describe a fictional person as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_client(tiny_model_dir):
    """A server over a tiny random model (SmolLM2's tokenizer): fast, and its text is noise,
    so only the constraint makes the output valid."""
    from models.loaders import load_model, load_tokenizer

    srv = ServerThread(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir),
                       api_key=API_KEY, max_model_len=768, max_num_batched_tokens=64,
                       max_num_seqs=16, num_kv_blocks=16 * 48, warmup=False)
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0,
                        timeout=300)
    srv.stop()


@pytest.mark.slow
def test_fifty_sampled_json_schema_completions_validate(tiny_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def one(seed):
        return tiny_client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, n=5, seed=seed, temperature=1.0, max_tokens=700,
            response_format=fmt)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(one, range(10)))
    contents = [c.message.content for r in replies for c in r.choices]
    assert len(contents) == 50
    for r in replies:
        assert all(c.finish_reason == "stop" for c in r.choices), r
    for text in contents:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(contents)) == 50  # sampled, seeded per request


def test_json_object_and_completions_guided_fields(client):
    ok = [{"role": "user", "content": "Reply with a JSON object whose key 'ok' is true."}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=ok, temperature=0,
                                       max_tokens=120, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    r = client.completions.create(model=MODEL_NAME, prompt="The date today is", n=4, seed=7,
                                  temperature=1.0, max_tokens=20,
                                  extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.text) for c in r.choices), [c.text for c in r.choices]
    choices = ["positive", "negative", "neutral"]
    r = client.completions.create(model=MODEL_NAME, prompt="Sentiment of 'I love it':", n=4,
                                  seed=3, temperature=1.0, max_tokens=8,
                                  extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices for c in r.choices), [c.text for c in r.choices]
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, temperature=0,
                                       max_tokens=8, extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices


def test_named_tool_call_has_valid_arguments(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=WEATHER_ASK, tools=[WEATHER, TIME], temperature=0,
        max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.message.content == "" and choice.finish_reason == "stop"  # as vLLM
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_calls_validate(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice="required",
        temperature=1.0, seed=5, n=3, max_tokens=100)
    # NOTE: at temperature 1 a choice may keep adding calls to the array until max_tokens
    # cuts it ("length"); every choice that ends does so with valid calls.
    done = [c for c in r.choices if c.finish_reason != "length"]
    assert done, [c.message.content for c in r.choices]
    for choice in done:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments),
                                tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_streamed_tool_call_reassembles_to_the_whole_call(client, tool_choice):
    kw = dict(model=MODEL_NAME, messages=WEATHER_ASK, tools=[WEATHER, TIME], temperature=0,
              max_tokens=100, tool_choice=tool_choice)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    got = [calls[i] for i in sorted(calls)]
    assert [(c["name"], c["arguments"]) for c in got] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"] and c["id"].startswith("call_") for c in got)
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls")


def test_auto_tool_choice_parses_hermes_calls(client):
    # The reply continues an assistant message that already holds a hermes call (echoed),
    # so the parser's input is known whatever the model adds after it.
    args = {"city": "Paris", "unit": "celsius"}
    prefix = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': args})}\n</tool_call>"
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[*WEATHER_ASK, {"role": "assistant", "content": prefix}],
        tools=[WEATHER], temperature=0, max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True, "allowed_token_ids": [EOS]})  # ends at once: "stop"
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == args
    plain = client.chat.completions.create(model=MODEL_NAME, messages=WEATHER_ASK,
                                           tools=[WEATHER], temperature=0, max_tokens=8)
    assert plain.choices[0].message.tool_calls == []  # no call syntax: content
    assert plain.choices[0].message.content




def _valid(texts) -> int:
    ok = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), NESTED)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


@pytest.mark.slow
def test_forty_samples_of_a_nested_schema_parse_and_validate(client):
    """SmolLM2 at temperature 1 with 160 tokens: a schema that lists its properties gets
    no invented keys and no whitespace runs (before the strict default, 25 of 40 broke)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": NESTED}}
    describe = {"type": "function", "function": {"name": "describe", "parameters": NESTED}}
    texts, args = [], []
    for seed in range(5):
        r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, n=8, seed=seed,
                                           temperature=1.0, max_tokens=160,
                                           response_format=fmt)
        texts += [c.message.content for c in r.choices]
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, n=8, seed=seed, temperature=1.0, max_tokens=160,
            tools=[describe], tool_choice={"type": "function", "function": {"name": "describe"}})
        args += [c.message.tool_calls[0].function.arguments for c in r.choices]
    assert len(texts) == len(args) == 40
    assert _valid(texts) >= 38 and _valid(args) >= 38, (_valid(texts), _valid(args))

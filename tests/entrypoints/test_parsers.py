"""The reasoning parsers and the tool-call parsers on hand-written model outputs, whole and
streamed in pieces of every size: what a stream sends adds up to the whole reply's split."""

from __future__ import annotations

import json
import re

import pytest

from jaxserve.entrypoints.cli import main
from jaxserve.entrypoints.openai.reasoning import get_reasoning_parser, thinking_disabled
from jaxserve.entrypoints.openai.serving_base import ServingLimits
from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, reply_message
from jaxserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    get_tool_parser,
    parse_tool_calls,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "temp": {"type": "number"}, "when": {"type": ["string", "null"]},
        "opts": {"type": "object"}, "hours": {"type": "array"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]

# (parser, model output, expected content, expected [(name, arguments)]): what each model
# family writes (the formats of their chat templates and vLLM's parsers).
CALLS = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": '
               '"get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris", "days": 3}),
                      ("get_time", {"zone": "CET"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"days": 3}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
     None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]),
    ("llama3_json", '{"name": "get_weather", "arguments": {"city": "Zürich"}}', None,
     [("get_weather", {"city": "Zürich"})]),
    ("mistral", 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
     "Sure.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{"zone": "CET"}',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("pythonic", "[get_weather(city='Paris', days=-3, metric=True, hours=[1, 2], "
                 "opts={'a': None}), get_time()]",
     None, [("get_weather", {"city": "Paris", "days": -3, "metric": True, "hours": [1, 2],
                             "opts": {"a": None}}), ("get_time", {})]),
    ("qwen3_coder", "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter="
                    "metric>\nTrue\n</parameter>\n<parameter=temp>\n21.5\n</parameter>\n"
                    "<parameter=when>\nnull\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n"
                    "</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\n"
                    "UTC\n</parameter>\n</function>\n</tool_call>",
     "I'll check.\n", [("get_weather", {"city": "New York", "days": 3, "metric": True,
                                        "temp": 21.5, "when": None, "opts": {"a": [1]},
                                        "extra": "42"}), ("get_time", {"zone": "UTC"})]),
    ("qwen3_coder", "<function=get_time>\n<parameter=zone>\nUTC\n", None,  # cut off, no wrapper
     [("get_time", {"zone": "UTC"})]),
]

# Replies that look like calls but do not parse: content, no calls (as vLLM).
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}'),
    ("llama3_json", '{"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par'),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]'),
    ("pythonic", "[get_weather('Paris')]"),
    ("pythonic", "[get_weather(city=paris)]"),
    ("pythonic", "[get_weather(city='Paris')] and more"),
    ("pythonic", "[1, 2, 3]"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather\n</tool_call>"),
]
PLAIN = "The weather in Paris is sunny, {mostly}; see [1]."


def named_args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", CALLS)
def test_each_parser_reads_its_models_calls(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text, TOOLS)
    assert got_content == content and named_args(got) == calls
    for call in got:
        assert set(call) == {"id", "type", "function"} and call["type"] == "function"
        assert isinstance(call["function"]["arguments"], str)
        if parser == "mistral":  # Mistral's templates take 9 alphanumerics
            assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
        else:
            assert call["id"].startswith("call_")
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_a_reply_that_does_not_parse_stays_content(parser, text):
    assert parse_tool_calls(parser, text, TOOLS) == (text, [])


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_plain_text_is_content_for_every_parser(parser):
    assert parse_tool_calls(parser, PLAIN, TOOLS) == (PLAIN, [])


def stream_tools(parser: str, text: str, size: int, finish: str = "stop"):
    """(content, calls by index, finish_reason, deltas) of `text` streamed `size` characters
    at a time through `ToolCallStream`."""
    stream = ToolCallStream("auto", "auto", parser, TOOLS)
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    out = [stream.feed(p, None) for p in pieces[:-1]] + [stream.feed(pieces[-1], finish)]
    content = "".join(d.get("content", "") for d, _ in out)
    calls = {}
    for d, _ in out:
        for tc in d.get("tool_calls", []):
            assert tc["index"] not in calls
            calls[tc["index"]] = tc
    return content, calls, out[-1][1], [d for d, _ in out]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("parser, text, content, calls", CALLS)
def test_streamed_calls_add_up_to_the_whole_reply(parser, text, content, calls, size):
    got_content, got, finish, deltas = stream_tools(parser, text, size)
    assert finish == "tool_calls" and sorted(got) == list(range(len(calls)))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for _, c in sorted(got.items())] == calls
    assert all(set(c) == {"index", "id", "type", "function"} for c in got.values())
    assert got_content.strip() == (content or "").strip()
    for marker in get_tool_parser(parser).markers:  # no call text went out as content
        assert not any(marker in d.get("content", "") for d in deltas)


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("parser, text", MALFORMED + [(p, PLAIN) for p in TOOL_PARSERS])
def test_streamed_text_without_calls_is_all_sent_as_content(parser, text, size):
    content, calls, finish, _ = stream_tools(parser, text, size)
    assert (content, calls, finish) == (text, {}, "stop")


def test_stream_sends_content_before_a_call_as_it_comes():
    stream = ToolCallStream("auto", "auto", "hermes", TOOLS)
    assert stream.feed("Let me look.", None)[0] == {"content": "Let me look."}
    # the start of a marker is held until it is clearly not one
    assert stream.feed(" <tool", None)[0] == {"content": " "}
    assert stream.feed("_call>{", None)[0] == {}
    last, finish = stream.feed('"name": "get_time", "arguments": {}}', "stop")
    assert finish == "tool_calls" and "content" not in last
    assert last["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    # a reply that starts otherwise is content at once for the at-start formats
    stream = ToolCallStream("auto", "auto", "llama3_json", TOOLS)
    assert stream.feed("Hello {", None)[0] == {"content": "Hello {"}
    stream = ToolCallStream("auto", "auto", "pythonic", TOOLS)
    assert stream.feed("  [get_", None)[0] == {}


def test_a_reply_cut_off_inside_a_call_ends_with_its_finish_reason():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci'
    content, calls, finish, _ = stream_tools("mistral", text, 4, finish="length")
    assert (content, calls, finish) == (text, {}, "length")
    message, finish = reply_message("auto", text, "auto", "length", parser="mistral")
    assert message["content"] == text and message["tool_calls"] == [] and finish == "length"
    message, finish = reply_message("auto", CALLS[0][1], "auto", "length", parser="hermes")
    assert len(message["tool_calls"]) == 2 and finish == "length"


THINK = [
    # (text, qwen3's (reasoning, content), deepseek_r1's)
    ("<think>\nThe user greets.\n</think>\n\nHello!", ("\nThe user greets.\n", "\n\nHello!"),
     ("\nThe user greets.\n", "\n\nHello!")),
    ("The user greets.\n</think>\n\nHello!", (None, "The user greets.\n</think>\n\nHello!"),
     ("The user greets.\n", "\n\nHello!")),
    ("Hello!", (None, "Hello!"), ("Hello!", None)),
    ("<think>Cut off while thinking", ("Cut off while thinking", None),
     ("Cut off while thinking", None)),
    ("<think>a</think>", ("a", None), ("a", None)),
    ("<think>a</think>b<think>c</think>", ("a", "b<think>c</think>"),
     ("a", "b<think>c</think>")),
    ("x < y </thinking> <thi", (None, "x < y </thinking> <thi"), ("x < y </thinking> <thi", None)),
]


@pytest.mark.parametrize("name, which", [("qwen3", 1), ("deepseek_r1", 2)])
@pytest.mark.parametrize("case", THINK, ids=range(len(THINK)))
def test_reasoning_parsers_split_whole_and_streamed_alike(name, which, case):
    parser, text, expected = get_reasoning_parser(name), case[0], case[which]
    assert parser.split(text) == expected
    for size in (1, 2, 7):
        stream = parser.stream()
        pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i:i + size])]
        pieces += stream.flush()
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        content = "".join(t for k, t in pieces if k == "content")
        assert (reasoning or None, content or None) == (expected[0] or None, expected[1] or None)
        assert not any("<think>" in t or "</think>" in t for k, t in pieces if k == "reasoning")


def test_thinking_is_off_when_the_template_kwargs_turn_it_off():
    assert thinking_disabled({"enable_thinking": False}) and thinking_disabled({"thinking": False})
    assert not thinking_disabled(None) and not thinking_disabled({"enable_thinking": True})
    assert not thinking_disabled({"enable_thinking": 0})  # only false itself


@pytest.mark.parametrize("kwargs, words", [
    ({"tool_call_parser": "llama3"}, "unknown tool call parser 'llama3': choose from hermes, "
                                     "llama3_json, mistral, openai, pythonic, qwen3_coder"),
    ({"reasoning_parser": "deepseek"}, "unknown reasoning parser 'deepseek': choose from "
                                       "deepseek_r1, openai_gptoss, qwen3"),
])
def test_an_unknown_parser_name_is_an_error_naming_the_choices(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ServingLimits(**kwargs)
    with pytest.raises(ValueError, match=re.escape(words)):
        (get_tool_parser if "tool_call_parser" in kwargs else get_reasoning_parser)(
            next(iter(kwargs.values())))


@pytest.mark.parametrize("flag, value", [("--tool-call-parser", "llama3"),
                                         ("--reasoning-parser", "deepseek")])
def test_the_server_refuses_an_unknown_parser_at_start_up(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"invalid choice: '{value}'" in err and "qwen3" in err

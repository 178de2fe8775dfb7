"""The hermes tool-call parser and the streamed tool-call deltas, on fixed texts."""

from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints.openai.tool_calls import (
    ToolCallStream,
    hermes_calls,
    reply_message,
    tool_mode,
)

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
NAMED = {"type": "function", "function": {"name": "f"}}


def test_hermes_parses_calls_and_keeps_content_before_them():
    content, calls = hermes_calls("Let me check.\n" + CALL + CALL.replace('"f"', '"g"'))
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("f", {"x": 1}), ("g", {"x": 1})]
    assert len({c["id"] for c in calls}) == 2
    # the model may stop (EOS) before closing the last block
    assert hermes_calls(CALL[:-len("</tool_call>")])[1][0]["function"]["name"] == "f"


@pytest.mark.parametrize("text", ["no call here", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_leaves_other_text_as_content(text):
    assert hermes_calls(text) == (text, [])


def test_reply_message_by_mode():
    msg, finish = reply_message("auto", "hi " + CALL, "auto", "stop")
    assert finish == "tool_calls" and msg["content"] == "hi" and len(msg["tool_calls"]) == 1
    msg, finish = reply_message("named", '{"x": 2}', NAMED, "stop")
    assert finish == "stop" and msg["content"] == ""  # as vLLM
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 2}'}
    msg, finish = reply_message("required", '[{"name": "f", "parameters": {"x": 3}}]',
                                "required", "stop")
    assert finish == "tool_calls" and json.loads(msg["tool_calls"][0]["function"]["arguments"]) \
        == {"x": 3}
    # cut off (max_tokens, or a stop string ending it "stop"): no call can be read, the
    # text stays content
    for why in ("length", "stop"):
        msg, finish = reply_message("required", '[{"name": "f", "par', "required", why)
        assert finish == why and msg["content"] == '[{"name": "f", "par' \
            and msg["tool_calls"] == []
    # a named call is returned even when cut short, as vLLM does (the finish says so)
    msg, finish = reply_message("named", '{"x": ', NAMED, "length")
    assert finish == "length" and msg["tool_calls"][0]["function"]["arguments"] == '{"x": '


def test_tool_call_arguments_sent_back_reach_the_template_as_objects():
    from jaxserve.entrypoints.openai.protocol import ChatMessage

    m = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "f",
                                                          "arguments": '{"x": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{oops"}}])
    calls = m.as_template_message()["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"x": 1}
    assert calls[1]["function"]["arguments"] == "{oops"  # not JSON: kept as sent
    assert tool_mode(None, "auto") is None and tool_mode([{}], "none") is None
    assert tool_mode([{}], None) == "auto" and tool_mode([{}], NAMED) == "named"


def run_stream(mode, choice, pieces, finish="stop"):
    s = ToolCallStream(mode, choice)
    out = [s.feed(p, None) for p in pieces[:-1]] + [s.feed(pieces[-1], finish)]
    content = "".join(d.get("content", "") for d, _ in out)
    calls: dict[int, dict] = {}
    for d, _ in out:
        for tc in d.get("tool_calls", []):
            e = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            e["name"] += tc.get("function", {}).get("name", "")
            e["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, calls, out[-1][1], out


def test_auto_stream_holds_back_a_possible_call_start():
    text = "Sure. " + CALL
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    content, calls, finish, out = run_stream("auto", "auto", pieces)
    assert content.strip() == "Sure." and finish == "tool_calls"
    assert calls == {0: {"name": "f", "arguments": '{"x": 1}'}}
    assert not any("<" in d.get("content", "") for d, _ in out)
    # text that only looked like a call start is sent once it is clearly not one
    content, calls, finish, _ = run_stream("auto", "auto", ["a <to", "y> b"])
    assert (content, calls, finish) == ("a <toy> b", {}, "stop")


def test_named_stream_sends_arguments_as_they_come():
    content, calls, finish, out = run_stream("named", NAMED, ['{"x"', ': 5}', ""])
    assert content == "" and finish == "stop"
    assert calls == {0: {"name": "f", "arguments": '{"x": 5}'}}
    assert out[0][0]["tool_calls"][0]["id"].startswith("call_")

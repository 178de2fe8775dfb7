"""`--reasoning-parser` and every `--tool-call-parser` end to end: the official `openai` client
against servers over an engine that answers canned model outputs, streamed and whole."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import ServingLimits, build_app
from jaxserve.outputs import CompletionOutput, RequestOutput
from tests.entrypoints.conftest import running_server, sse_events
from tests.entrypoints.fake_engine import ScriptedEngine
from tests.entrypoints.test_parsers import CALLS, TOOLS
from tests.entrypoints.test_response_shapes import SHAPES, keys

# Canned replies by name: the user message names the one the engine answers.
REPLIES = {
    "think": "<think>\nThe user says hi. I should greet back.\n</think>\n\nHello there!",
    "r1": "The user says hi.\n</think>\n\nHello there!",
    "plain": "Just the answer.",
    "think_then_call": '<think>\nI need the weather; <tool_call> comes next.\n</think>\n\n'
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                       '\n</tool_call>',
    "broken": '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
    **{f"call_{i}": text for i, (_, text, _, _) in enumerate(CALLS)},
}
# One case per tool-call parser (the first of CALLS for each).
PARSER_CASES = {parser: i for i, (parser, *_) in reversed(list(enumerate(CALLS)))}
THINK_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                  "{% if enable_thinking is defined and not enable_thinking %}"
                  "<think>\n\n</think>\n\n{% endif %}")


class CannedEngine(ScriptedEngine):
    """Answers each request with the canned reply its prompt names, 4 characters a step
    (one token each), then stops; keeps the decoded prompts."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, REPLIES)

    def step(self):
        time.sleep(self.step_seconds)
        outputs = []
        for rid, ((reply, prompt), params, tokens, metrics) in list(self.running.items()):
            tokens.append(len(tokens))
            metrics.first_token_time = metrics.first_token_time or time.time()
            text = reply[:4 * len(tokens)]
            done = len(text) == len(reply) or len(tokens) >= params.max_tokens
            finish = None if not done else "stop" if len(text) == len(reply) else "length"
            if done:
                del self.running[rid]
            comp = CompletionOutput(0, text, list(tokens), finish_reason=finish)
            outputs.append(RequestOutput(rid, prompt, [1, 2], [comp], done, metrics))
        return outputs


@pytest.fixture(scope="module")
def servers(smollm2_tokenizer):
    """`connect(tool_parser, reasoning_parser)`: an `openai` client of a server with those
    parsers over a `CannedEngine` (started on first use, kept for the module), and its
    engine."""
    with contextlib.ExitStack() as stack:
        made = {}

        def connect(tool_parser="hermes", reasoning_parser=None):
            key = (tool_parser, reasoning_parser)
            if key not in made:
                engine = CannedEngine(smollm2_tokenizer)
                llm = AsyncLLM(engine, log_interval=0)
                stack.callback(llm.shutdown)
                app = build_app(llm, ["fake"], limits=ServingLimits(
                    tool_call_parser=tool_parser, reasoning_parser=reasoning_parser))
                url = stack.enter_context(running_server(app))[1]
                made[key] = openai.OpenAI(base_url=f"{url}/v1", api_key="unused",
                                          max_retries=0, timeout=30), engine
            return made[key]

        yield connect


def ask(client, reply: str, stream: bool, **body):
    """The reply to a chat request answered with canned `reply`: (message dict, finish) when
    whole; streamed, the deltas joined: (content, reasoning, calls by index, finish,
    chunks)."""
    messages = [{"role": "user", "content": f"[{reply}] hi"}]
    out = client.chat.completions.create(model="fake", messages=messages, max_tokens=500,
                                         stream=stream, **body)
    if not stream:
        choice = out.choices[0]
        return choice.message.model_dump(), choice.finish_reason
    content, reasoning, calls, finish, chunks = "", "", {}, None, list(out)
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.model_dump()
        finish = chunk.choices[0].finish_reason or finish
        content += delta.get("content") or ""
        assert delta.get("reasoning_content") == delta.get("reasoning")  # vLLM's copy
        reasoning += delta.get("reasoning") or ""
        for tc in delta.get("tool_calls") or []:
            assert tc["index"] not in calls
            calls[tc["index"]] = tc
    return content, reasoning, calls, finish, chunks


@pytest.mark.parametrize("parser", sorted(PARSER_CASES))
def test_each_tool_parser_through_the_openai_client(servers, parser):
    client, engine = servers(parser)
    _, _, content, calls = CALLS[PARSER_CASES[parser]]
    reply = f"call_{PARSER_CASES[parser]}"
    message, finish = ask(client, reply, False, tools=TOOLS)
    assert finish == "tool_calls" and message["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == calls
    assert all(c["type"] == "function" and c["id"] for c in message["tool_calls"])
    streamed, _, got, finish, _ = ask(client, reply, True, tools=TOOLS)
    assert finish == "tool_calls" and streamed.strip() == (content or "").strip()
    assert sorted(got) == list(range(len(calls)))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for _, c in sorted(got.items())] == calls
    assert all(c["type"] == "function" and c["id"] for c in got.values())
    # Mistral's marker is a special token: kept in the text for the parser, as vLLM
    assert engine.params[-1].skip_special_tokens == (parser != "mistral")


def test_a_malformed_call_stays_content(servers):
    client, _ = servers("hermes")
    message, finish = ask(client, "broken", False, tools=TOOLS)
    assert (message["content"], message["tool_calls"], finish) == (REPLIES["broken"], [], "stop")
    content, _, calls, finish, _ = ask(client, "broken", True, tools=TOOLS)
    assert (content, calls, finish) == (REPLIES["broken"], {}, "stop")


@pytest.mark.parametrize("parser, reply", [("qwen3", "think"), ("deepseek_r1", "r1")])
def test_reasoning_parsers_split_reasoning_from_content(servers, parser, reply):
    client, _ = servers("hermes", parser)
    expected = ("\nThe user says hi. I should greet back.\n" if reply == "think"
                else "The user says hi.\n")
    message, finish = ask(client, reply, False)
    assert finish == "stop" and message["content"] == "\n\nHello there!"
    assert message["reasoning"] == message["reasoning_content"] == expected
    content, reasoning, _, finish, chunks = ask(client, reply, True)
    assert (content, reasoning, finish) == ("\n\nHello there!", expected, "stop")
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    # reasoning deltas first, then content (one delta may hold the end of both)
    first = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert any(d.get("reasoning") for d in deltas[:first + 1])
    assert not any(d.get("reasoning") for d in deltas[first + 1:])
    assert not any("think>" in (d.get("content") or "") for d in deltas)
    # vLLM's include_reasoning=false drops it; the content is the same
    message, _ = ask(client, reply, False, extra_body={"include_reasoning": False})
    assert message["reasoning"] is None and message["content"] == "\n\nHello there!"


def test_qwen3_without_a_think_block_is_all_content_and_deepseek_r1_all_reasoning(servers):
    message, _ = ask(servers("hermes", "qwen3")[0], "plain", False)
    assert (message["content"], message["reasoning"]) == ("Just the answer.", None)
    message, _ = ask(servers("hermes", "deepseek_r1")[0], "plain", False)
    assert (message["content"], message["reasoning"]) == (None, "Just the answer.")


@pytest.mark.parametrize("stream", [False, True])
def test_enable_thinking_false_reaches_the_template_and_splits_nothing(servers, stream):
    client, engine = servers("hermes", "deepseek_r1")
    off = {"chat_template": THINK_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}}
    out = ask(client, "plain", stream, extra_body=off)
    assert engine.prompts[-1].endswith("<think>\n\n</think>\n\n")  # the template saw it
    if stream:
        assert out[:2] == ("Just the answer.", "")
    else:
        assert (out[0]["content"], out[0]["reasoning"]) == ("Just the answer.", None)
    ask(client, "plain", stream, extra_body={**off, "chat_template_kwargs": {}})
    assert not engine.prompts[-1].endswith("</think>\n\n")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_never_reaches_the_tool_parser(servers, stream):
    client, _ = servers("hermes", "qwen3")
    out = ask(client, "think_then_call", stream, tools=TOOLS)
    if stream:
        content, reasoning, calls, finish, _ = out
        assert "<tool_call> comes next" in reasoning and content.strip() == ""
        names = [c["function"]["name"] for c in calls.values()]
    else:
        message, finish = out
        assert "<tool_call> comes next" in message["reasoning"] and message["content"] is None
        names = [c["function"]["name"] for c in message["tool_calls"]]
    assert finish == "tool_calls" and names == ["get_weather"]


def test_reasoning_messages_and_deltas_have_the_tabled_keys(servers):
    client, _ = servers("hermes", "qwen3")
    body = {"model": "fake", "messages": [{"role": "user", "content": "[think] hi"}],
            "max_tokens": 500}
    url = str(client.base_url).rstrip("/")
    message = httpx.post(f"{url}/chat/completions", json=body, timeout=30).json()[
        "choices"][0]["message"]
    keys(message, "chat message")
    with httpx.stream("POST", f"{url}/chat/completions", json={**body, "stream": True},
                      timeout=30) as r:
        deltas = [e["choices"][0]["delta"] for e in sse_events(r)[1:-1]]
    thinking = [d for d in deltas if d.get("reasoning")]
    assert thinking and all(set(d) - {"content"} == SHAPES["chat reasoning delta"]
                            for d in thinking)
    for d in deltas:
        if not d.get("reasoning"):
            keys(d, "chat delta" if d.get("content") else "chat empty delta")

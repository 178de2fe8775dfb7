"""gpt-oss's harmony format through the server and the official `openai` client: a server with
`--reasoning-parser openai_gptoss --tool-call-parser openai` over an engine that answers
hand-written harmony replies one token a step; chat completions and `/v1/responses`, whole
and streamed, and the prompt a harmony chat template renders."""

from __future__ import annotations

import copy
import json
import time

import httpx
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import ServingLimits, build_app
from jaxserve.entrypoints.openai.harmony import SPECIAL_TOKENS
from jaxserve.outputs import CompletionOutput, RequestOutput
from tests.entrypoints.conftest import running_server
from tests.entrypoints.fake_engine import ScriptedEngine
from tests.entrypoints.test_parsers_harmony import REPLIES, named_args

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
# A harmony chat template as gpt-oss's own renders a conversation (written from OpenAI's
# harmony guide; the test's oracle is the text below, `EXPECTED_PROMPT`): the assistant's
# reasoning reaches it as `thinking` (transformers' alias of `reasoning_content`), a tool's
# result is a message from `functions.NAME` to the assistant.
TEMPLATE = (
    '{{- "<|start|>system<|message|>Reasoning: " + (reasoning_effort or "medium") + "<|end|>" -}}'
    "{%- set last = namespace(name=none) -%}"
    "{%- for m in messages -%}"
    '{%- if m.role in ("system", "developer") -%}'
    '{{- "<|start|>developer<|message|># Instructions\\n\\n" + m.content + "<|end|>" -}}'
    '{%- elif m.role == "user" -%}{{- "<|start|>user<|message|>" + m.content + "<|end|>" -}}'
    '{%- elif m.role == "assistant" and m.tool_calls -%}'
    '{%- if m.thinking -%}'
    '{{- "<|start|>assistant<|channel|>analysis<|message|>" + m.thinking + "<|end|>" -}}'
    "{%- endif -%}"
    "{%- for c in m.tool_calls -%}"
    '{{- "<|start|>assistant to=functions." + c.function.name + "<|channel|>commentary json'
    '<|message|>" + c.function.arguments | tojson + "<|call|>" -}}'
    "{%- set last.name = c.function.name -%}"
    "{%- endfor -%}"
    '{%- elif m.role == "assistant" -%}'
    '{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}'
    '{%- elif m.role == "tool" -%}'
    '{{- "<|start|>functions." + last.name + " to=assistant<|channel|>commentary<|message|>"'
    ' + m.content + "<|end|>" -}}'
    "{%- endif -%}"
    "{%- endfor -%}"
    '{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}')


class HarmonyEngine(ScriptedEngine):
    """Answers each request with the reply of `REPLIES` its prompt names (`[name]`), one
    token a step, its text decoded as the request asks (`skip_special_tokens`); keeps the
    decoded prompts and the parameters."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, REPLIES, skip_special_tokens=False)

    def script(self, reply):
        return self.tokenizer(reply[0], add_special_tokens=False).input_ids

    def step(self):
        time.sleep(self.step_seconds)
        outputs = []
        for rid, ((ids, prompt), params, tokens, metrics) in list(self.running.items()):
            tokens.append(ids[len(tokens)])
            done = len(tokens) == len(ids) or len(tokens) >= (params.max_tokens or len(ids))
            if done:
                del self.running[rid]
            text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
            comp = CompletionOutput(0, text, list(tokens), finish_reason=None if not done
                                    else "stop" if len(tokens) == len(ids) else "length")
            outputs.append(RequestOutput(rid, prompt, [1, 2], [comp], done, metrics))
        return outputs


@pytest.fixture(scope="module")
def served(smollm2_tokenizer):
    """(client, engine, url): the `openai` client of a server with both harmony parsers over
    a `HarmonyEngine` whose tokenizer has harmony's special tokens and `TEMPLATE`."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.chat_template = TEMPLATE
    engine = HarmonyEngine(tokenizer)
    llm = AsyncLLM(engine, log_interval=0)
    limits = ServingLimits(tool_call_parser="openai", reasoning_parser="openai_gptoss")
    try:
        with running_server(build_app(llm, ["fake"], limits=limits)) as (_, url):
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0,
                                timeout=30), engine, url
    finally:
        llm.shutdown()


def chat(client, name: str, stream: bool, **body):
    """(reasoning, content, [(name, arguments)], finish_reason) of a chat reply answered with
    `REPLIES[name]`; streamed, the deltas joined (checking no special token leaks)."""
    out = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": f"[{name}] hi"}], max_tokens=500,
        stream=stream, **body)
    if not stream:
        message = out.choices[0].message.model_dump()
        assert message["reasoning_content"] == message["reasoning"]  # vLLM's copy
        calls = message["tool_calls"] or []
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
        return message["reasoning"], message["content"], named_args(calls), \
            out.choices[0].finish_reason
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in out:
        delta = chunk.choices[0].delta.model_dump()
        finish = chunk.choices[0].finish_reason or finish
        assert not any(t in (delta.get(k) or "") for t in SPECIAL_TOKENS
                       for k in ("content", "reasoning"))
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            if tc["id"]:
                calls[tc["index"]] = {"function": dict(tc["function"])}
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    return reasoning or None, content or None, named_args(calls[i] for i in sorted(calls)), \
        finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_splits_reasoning_content_and_tool_calls(served, stream):
    client, engine, _ = served
    for name in ("answer", "preamble_two_calls"):
        _, reasoning, content, calls = REPLIES[name]
        assert chat(client, name, stream, tools=TOOLS) == (
            reasoning, content, calls, "tool_calls" if calls else "stop")
        assert engine.params[-1].skip_special_tokens is False  # the markers reach the parser
    # without tools the calls are dropped; include_reasoning=false drops the reasoning
    assert chat(client, "call", stream) == (REPLIES["call"][1], None, [], "stop")
    assert chat(client, "answer", stream, extra_body={"include_reasoning": False}) == (
        None, REPLIES["answer"][2], [], "stop")


def test_the_conversation_is_rendered_as_harmony(served):
    client, engine, _ = served
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    client.chat.completions.create(model="fake", max_tokens=500, tools=TOOLS, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        {"role": "assistant", "content": "Clear."},
        {"role": "user", "content": "[answer] Thanks"}])
    assert engine.prompts[-1] == (
        "<|start|>system<|message|>Reasoning: medium<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '{"sky": "clear"}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Clear.<|end|>"
        "<|start|>user<|message|>[answer] Thanks<|end|><|start|>assistant")


def test_responses_reasoning_message_and_function_call_items(served):
    client, engine, url = served
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    r = client.responses.create(model="fake", input="[preamble_two_calls] hi", tools=tools,
                                reasoning={"effort": "low"})
    assert "Reasoning: low" in engine.prompts[-1]
    reasoning, message, *calls = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == ["Two lookups."]
    assert message.type == "message" and message.content[0].text == "Checking both."
    assert [(c.type, c.name, json.loads(c.arguments)) for c in calls] == [
        ("function_call", n, a) for n, a in REPLIES["preamble_two_calls"][3]]
    # streamed: the reasoning item first, its text in reasoning_text deltas
    with httpx.stream("POST", f"{url}/v1/responses", timeout=30, json={
            "model": "fake", "input": "[answer] hi", "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert events[2]["item"]["type"] == "reasoning"
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert text == done["text"] == REPLIES["answer"][1]
    final = events[-1]["response"]
    assert kinds[-1] == "response.completed" and [i["type"] for i in final["output"]] == [
        "reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text",
                                              "text": REPLIES["answer"][1]}]
    assert final["output"][1]["content"][0]["text"] == REPLIES["answer"][2]


def test_a_responses_tool_loop_sends_the_reasoning_back(served):
    """The client's tool loop with gpt-oss: the first response's output (a reasoning item, a
    function call) and the call's result as the next input; the reasoning is rendered as
    the analysis before the call (what gpt-oss's template does for a tool call)."""
    client, engine, _ = served
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    question = {"role": "user", "content": "[call] Weather?"}
    first = client.responses.create(model="fake", input=[question], tools=tools)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    client.responses.create(model="fake", tools=tools, input=[
        question, *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert engine.prompts[-1].endswith(
        "<|start|>user<|message|>[call] Weather?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 3}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny"
        "<|end|><|start|>assistant")

"""`POST /v1/responses` with the official `openai` client (`client.responses.create`), whole
and streamed, text and function tools, over a fake engine that replies with canned text; the
errors; and one greedy reply of the default model against its chat completion."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from tests.entrypoints.conftest import MODEL_NAME, running_server
from tests.entrypoints.fake_engine import FakeEngine

# The keys of vLLM's `ResponsesResponse` (vllm/entrypoints/openai/responses/protocol.py,
# `model_dump()`), its `ResponseUsage` and the output items' (openai.types.responses).
RESPONSE_KEYS = {"id", "created_at", "incomplete_details", "instructions", "metadata", "model",
                 "object", "output", "parallel_tool_calls", "temperature", "tool_choice",
                 "tools", "top_p", "background", "max_output_tokens", "max_tool_calls",
                 "previous_response_id", "prompt", "reasoning", "service_tier", "status",
                 "text", "top_logprobs", "truncation", "usage", "user", "input_messages",
                 "output_messages"}
USAGE_KEYS = {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details",
              "total_tokens"}
MESSAGE_KEYS = {"id", "type", "role", "status", "content"}
CALL_KEYS = {"id", "type", "status", "call_id", "name", "arguments"}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
# The same tool in the chat form (the oracle prompts are rendered with it).
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                if k != "type"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class CannedEngine(FakeEngine):
    """Replies `reply` in pieces of 4 characters, one per step (a token each), until the
    reply or `max_tokens` ends; remembers the last request's prompt ids and parameters.
    A `reply` of None makes the step fail."""

    reply: str | None = "Hello there, friend."

    def add_request(self, request_id, prompt, params, **kwargs):
        super().add_request(request_id, prompt, params, **kwargs)
        self.seen = (prompt["prompt_token_ids"], params)

    def pieces(self) -> list[str]:
        return [self.reply[i:i + 4] for i in range(0, len(self.reply), 4)]

    def step(self):
        time.sleep(self.step_seconds)
        if self.reply is None and self.running:
            raise RuntimeError("boom")
        outputs = []
        for rid, (prompt, params, tokens, metrics) in list(self.running.items()):
            pieces = self.pieces()
            tokens.append(len(tokens))
            limit = min(len(pieces), params.max_tokens or len(pieces))
            done = len(tokens) >= limit
            if done:
                del self.running[rid]
            comp = CompletionOutput(0, "".join(pieces[:len(tokens)]), list(tokens),
                                    finish_reason=None if not done else
                                    "stop" if len(tokens) == len(pieces) else "length")
            if params.logprobs is not None:
                comp.logprobs = [{t: Logprob(-0.5, 1, pieces[t])} for t in tokens]
            outputs.append(RequestOutput(rid, prompt, prompt["prompt_token_ids"], [comp], done,
                                         metrics, num_cached_tokens=3))
        return outputs


@pytest.fixture(scope="module")
def served(smollm2_tokenizer):
    """(engine, url, client): a server over the canned engine (the default model's
    tokenizer and chat template)."""
    engine = CannedEngine(step_seconds=0.002)
    engine.tokenizer = smollm2_tokenizer
    engine.limits.max_model_len = 256
    llm = AsyncLLM(engine, log_interval=0)
    try:
        with running_server(build_app(llm, ["fake"])) as (_, url):
            yield engine, url, openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    finally:
        llm.shutdown()


@pytest.fixture
def canned(served):
    """`served`, with the engine's reply reset after the test."""
    yield served
    served[0].reply = CannedEngine.reply


def tokenized(url: str, messages: list[dict], tools=None) -> list[int]:
    """The chat path's prompt for `messages` (`/tokenize`)."""
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(f"{url}/tokenize", json=body, timeout=30).json()["tokens"]


def raw_events(url: str, body: dict) -> list[dict]:
    """The streamed events, checking each `event:` line names its data's type."""
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def kinds_of(events: list[dict]) -> list[str]:
    """The events' types, each run of deltas as one (the engine's outputs may arrive
    coalesced, so a reply streams in one delta or several)."""
    kinds = [e["type"] for e in events]
    return [k for i, k in enumerate(kinds)
            if not (k.endswith(".delta") and i > 0 and kinds[i - 1] == k)]


def test_text_reply_whole(canned):
    engine, url, client = canned
    r = client.responses.create(model="fake", input="Hi", instructions="Be brief",
                                max_output_tokens=50, temperature=0.5, top_p=0.9,
                                metadata={"k": "v"})
    assert r.output_text == engine.reply and r.status == "completed"
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "fake"
    assert (r.instructions, r.temperature, r.top_p, r.max_output_tokens, r.metadata) == (
        "Be brief", 0.5, 0.9, 50, {"k": "v"})
    ids, params = engine.seen
    assert ids == tokenized(url, [{"role": "system", "content": "Be brief"},
                                  {"role": "user", "content": "Hi"}])
    assert (params.temperature, params.top_p, params.max_tokens) == (0.5, 0.9, 50)
    n = len(engine.pieces())
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        len(ids), n, len(ids) + n)
    assert r.usage.input_tokens_details.cached_tokens == 3
    body = httpx.post(f"{url}/v1/responses", json={"input": "Hi"}, timeout=30).json()
    assert set(body) == RESPONSE_KEYS and set(body["usage"]) == USAGE_KEYS
    (item,) = body["output"]
    assert set(item) == MESSAGE_KEYS and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "output_text", "text": engine.reply,
                                "annotations": [], "logprobs": None}]
    # no max_output_tokens: the rest of the context, as vLLM reports it
    assert body["max_output_tokens"] == 256 - body["usage"]["input_tokens"]


def test_cut_short_is_incomplete(canned):
    engine, _, client = canned
    r = client.responses.create(model="fake", input="Hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "".join(engine.pieces()[:2])


def test_input_items_become_the_conversation(canned):
    engine, url, client = canned
    client.responses.create(model="fake", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "},
                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
        tools=TOOLS)
    assert engine.seen[0] == tokenized(url, [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], CHAT_TOOLS)


def test_text_reply_streamed(canned):
    engine, url, client = canned
    events = raw_events(url, {"input": "Hi"})
    assert kinds_of(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and \
        events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = events[-2]["item"]
    assert text == engine.reply == events[-4]["text"] == done["content"][0]["text"]
    final = events[-1]["response"]
    assert set(final) == RESPONSE_KEYS and final["status"] == "completed"
    assert final["output"] == [done] and final["id"] == events[0]["response"]["id"]
    assert final["usage"]["output_tokens"] == len(engine.pieces())
    with client.responses.create(model="fake", input="Hi", stream=True) as stream:
        parsed = list(stream)
    assert parsed[-1].type == "response.completed"
    assert parsed[-1].response.output_text == engine.reply


def test_function_call_whole(canned):
    engine, url, client = canned
    engine.reply = "Let me check. " + CALL
    r = client.responses.create(model="fake", input="Weather in Paris?", tools=TOOLS)
    message, call = r.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    engine.reply = CALL
    body = httpx.post(f"{url}/v1/responses", json={"input": "Weather?", "tools": TOOLS},
                      timeout=30).json()
    (item,) = body["output"]  # no text: no message item
    assert set(item) == CALL_KEYS and item["status"] == "completed"
    assert body["tools"] == [{**TOOLS[0], "strict": None}]


def test_function_call_streamed(canned):
    engine, url, _ = canned
    engine.reply = "Let me check. " + CALL
    events = raw_events(url, {"input": "Weather?", "tools": TOOLS})
    assert kinds_of(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    message, added, done = [e for e in events if e["type"].startswith("response.output_item")][1:]
    by_kind = {e["type"]: e for e in events}
    args, args_done = (by_kind[f"response.function_call_arguments.{k}"] for k in ("delta", "done"))
    assert added["output_index"] == 1 and added["item"]["arguments"] == ""
    assert added["item"]["name"] == "get_weather" and added["item"]["status"] == "in_progress"
    assert json.loads(args["delta"]) == {"city": "Paris"} == json.loads(args_done["arguments"])
    assert args["item_id"] == done["item"]["id"] == added["item"]["id"]
    assert done["item"]["status"] == "completed"
    assert message["item"]["content"][0]["text"].strip() == "Let me check."
    assert events[-1]["response"]["output"] == [message["item"], done["item"]]


def test_named_tool_choice_constrains_and_streams_arguments(canned):
    engine, url, client = canned
    engine.reply = '{"city": "Paris"}'
    choice = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="fake", input="Weather?", tools=TOOLS,
                                tool_choice=choice)
    assert engine.seen[1].structured_outputs.json == TOOLS[0]["parameters"]
    (call,) = r.output
    assert (call.name, call.arguments) == ("get_weather", engine.reply)
    assert r.tool_choice.name == "get_weather"
    events = raw_events(url, {"input": "Weather?", "tools": TOOLS, "tool_choice": choice})
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert args and "".join(args) == engine.reply


def test_text_format_json_schema_and_logprobs(canned):
    engine, url, client = canned
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = {"format": {"type": "json_schema", "name": "thing", "schema": schema}}
    r = client.responses.create(model="fake", input="Hi", text=text)
    assert engine.seen[1].structured_outputs.json == schema
    assert r.text.format.type == "json_schema"
    body = {"input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    whole = httpx.post(f"{url}/v1/responses", json=body, timeout=30).json()
    part = whole["output"][0]["content"][0]
    assert [lp["token"] for lp in part["logprobs"]] == engine.pieces()
    assert whole["top_logprobs"] == 1 and part["logprobs"][0]["logprob"] == -0.5
    events = raw_events(url, body)
    streamed = [lp["token"] for e in events if e["type"] == "response.output_text.delta"
                for lp in e["logprobs"]]
    assert streamed == engine.pieces()


@pytest.mark.parametrize("body, param, words", [
    ({"input": 5}, "input", "valid string"),
    ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input", "input items are"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "at least one item"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input", "only input_text, output_text and input_image"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input", "'developer'"),
    ({"input": []}, "input", "at least one item"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0", "only function tools"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "not in tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id",
     "does not store responses"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", "text.format"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text",
     "needs schema"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 1000}, "max_output_tokens", "maximum context"),
    ({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 50},
     "top_logprobs", "Requested sample logprobs of 50, which is greater than max allowed: 20"),
    ({"input": "hi", "temperature": "hot"}, "temperature", "valid number"),
    ({"input": "hi", "seed": 2**63}, "seed", "less_than_equal"),
])
def test_bad_requests_are_400s_naming_the_field(served, body, param, words):
    _, url, _ = served
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["type"], error["code"]) == (param, "BadRequestError", 400)
    assert words in error["message"]


def test_errors_through_the_client_and_unknown_fields(served):
    engine, url, client = served
    with pytest.raises(openai.BadRequestError, match="does not store responses"):
        client.responses.create(model="fake", input="Hi", previous_response_id="resp_1")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="Hi")
    # unknown fields are ignored, as vLLM; store=false is what happens anyway
    r = httpx.post(f"{url}/v1/responses", json={"input": "Hi", "not_a_field": 1,
                                                "store": False}, timeout=30)
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == engine.reply


def test_a_failure_mid_stream_is_an_error_event(canned):
    engine, url, _ = canned
    engine.reply = None
    events = raw_events(url, {"input": "Hi"})
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "error"]
    assert events[-1]["code"] == "500" and "boom" in events[-1]["message"]


def test_greedy_reply_matches_the_chat_completion(client):
    """The default model's greedy reply through /v1/responses, whole and streamed, is its
    chat completion of the same conversation (the chat path is the oracle)."""
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                          temperature=0)
    r = client.responses.create(model=MODEL_NAME, input=messages[1]["content"],
                                instructions=messages[0]["content"], max_output_tokens=6,
                                temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with client.responses.create(input=messages[1]["content"],
                                 instructions=messages[0]["content"], max_output_tokens=6,
                                 temperature=0, stream=True) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == r.output_text


def test_a_tool_loop_sends_the_output_back(canned):
    """The client's tool loop: the previous response's output items, then the call's result,
    as the next request's input (nothing is stored between the two)."""
    engine, url, client = canned
    engine.reply = "Let me check. " + CALL
    question = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(model="fake", input=[question], tools=TOOLS)
    call = first.output[1]
    engine.reply = "Sunny in Paris."
    second = client.responses.create(model="fake", tools=TOOLS, input=[
        question, *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == "Sunny in Paris."
    assert engine.seen[0] == tokenized(url, [
        question,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}], CHAT_TOOLS)

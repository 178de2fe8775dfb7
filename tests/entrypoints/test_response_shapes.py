"""Every response's key sets, whole and streamed, against the table of vLLM's response models in
docs/openai_api.md ("Response shapes"), over a fake engine (the engine's numbers do not matter)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import httpx
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import ServingLimits, build_app
from jaxserve.outputs import Logprob
from tests.entrypoints.conftest import running_server, sse_events
from tests.entrypoints.fake_engine import FakeEngine

DOC = Path(__file__).parents[2] / "docs" / "openai_api.md"
PROMPT = {"model": "fake", "prompt": "Hello", "max_tokens": 3}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}
CACHED = 5  # prompt tokens the fake engine reports as prefix-cache hits


def shape_table() -> dict[str, set[str]]:
    """`{object: keys}` of the "Response shapes" table."""
    section = DOC.read_text().split("## Response shapes", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| object")]
    return {name.strip(): set(re.findall(r"`([a-z_]+)`", keys)) for name, keys in rows}


SHAPES = shape_table()


def keys(obj: dict, name: str) -> None:
    assert set(obj) == SHAPES[name], (name, sorted(set(obj) ^ SHAPES[name]), obj)


class ShapeEngine(FakeEngine):
    """The fake engine with what the shapes need: prefix-cache hits, logprobs and prompt
    logprobs when asked for."""

    def step(self):
        params = {rid: entry[1] for rid, entry in self.running.items()}
        outputs = super().step()
        for out in outputs:
            p = params[out.request_id]
            out.num_cached_tokens = CACHED
            if p.prompt_logprobs is not None:
                out.prompt_logprobs = [None, {2: Logprob(-1.0, 1, "b")}]
            for comp in out.outputs:
                if p.logprobs is not None:
                    comp.logprobs = [{t: Logprob(-0.5, 1, f"t{t} ")} for t in comp.token_ids]
        return outputs


@pytest.fixture(scope="module")
def urls(smollm2_tokenizer):
    """`{details: url}`: servers over the fake engine (the default model's tokenizer, for chat
    templates and /tokenize) without and with `--enable-prompt-tokens-details`."""
    with contextlib.ExitStack() as stack:
        out = {}
        for details in (False, True):
            engine = ShapeEngine(step_seconds=0.002)
            engine.tokenizer = smollm2_tokenizer
            engine.limits.max_model_len = 256
            llm = AsyncLLM(engine, log_interval=0)
            stack.callback(llm.shutdown)
            app = build_app(llm, ["fake"], limits=ServingLimits(
                enable_prompt_tokens_details=details))
            out[details] = stack.enter_context(running_server(app))[1]
        yield out


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_the_table_names_every_response_object():
    assert len(SHAPES) == 37 and all(SHAPES.values()), SHAPES


@pytest.mark.parametrize("details", [False, True])
def test_completion(urls, details):
    body = post(urls[details], "/v1/completions", {**PROMPT, "logprobs": 1}).json()
    keys(body, "completion")
    assert body["service_tier"] is body["system_fingerprint"] is body["kv_transfer_params"] \
        is None
    (choice,) = body["choices"]
    keys(choice, "completion choice")
    keys(choice["logprobs"], "completion logprobs")
    assert choice["prompt_logprobs"] is choice["token_ids"] is choice["prompt_token_ids"] is None
    keys(body["usage"], "usage")
    if details:  # vLLM's flag; the details only where some prompt tokens were cached
        keys(body["usage"]["prompt_tokens_details"], "prompt tokens details")
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED
    else:
        assert body["usage"]["prompt_tokens_details"] is None
    asked = post(urls[details], "/v1/completions", {**PROMPT, "prompt_logprobs": 1}).json()
    assert asked["choices"][0]["prompt_logprobs"][1]["2"]["logprob"] == -1.0
    assert asked["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("details", [False, True])
def test_completion_stream(urls, details):
    chunks = stream(urls[details], "/v1/completions", PROMPT)
    for chunk in chunks:  # no stream_options: no usage chunk, a null usage in each chunk
        keys(chunk, "completion chunk")
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        keys(choice, "completion chunk choice")
    # include_usage is vLLM's default once stream_options is given
    *chunks, last = stream(urls[details], "/v1/completions", {**PROMPT, "stream_options": {}})
    keys(last, "last usage chunk")
    assert last["choices"] == []
    keys(last["usage"], "last usage" if not details else "usage")
    continuous = stream(urls[details], "/v1/completions", {
        **PROMPT, "stream_options": {"continuous_usage_stats": True}})
    for chunk in continuous[:-1]:
        keys(chunk, "completion chunk")
        keys(chunk["usage"], "usage")


@pytest.mark.parametrize("details", [False, True])
def test_chat(urls, details):
    body = post(urls[details], "/v1/chat/completions", {
        **CHAT, "logprobs": True, "top_logprobs": 1}).json()
    keys(body, "chat completion")
    (choice,) = body["choices"]
    keys(choice, "chat choice")
    keys(choice["message"], "chat message")
    message = choice["message"]
    assert message["tool_calls"] == [] and message["content"] == "t0 t1 t2 "
    assert [message[k] for k in ("refusal", "annotations", "audio", "function_call",
                                 "reasoning", "reasoning_content")] == [None] * 6
    keys(choice["logprobs"], "chat logprobs")
    keys(choice["logprobs"]["content"][0], "chat logprob")
    keys(choice["logprobs"]["content"][0]["top_logprobs"][0], "chat top logprob")
    keys(body["usage"], "usage")
    assert (body["usage"]["prompt_tokens_details"] is not None) == details
    assert body["prompt_logprobs"] is None


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "f"}},
                                         "required", "auto"])
def test_chat_with_tools(urls, tool_choice):
    body = post(urls[False], "/v1/chat/completions", {
        **CHAT, "tools": [TOOL], "tool_choice": tool_choice}).json()
    message = body["choices"][0]["message"]
    keys(message, "chat message")
    if isinstance(tool_choice, dict):  # a named call: content "" beside it, as vLLM
        (call,) = message["tool_calls"]
        keys(call, "tool call")
        keys(call["function"], "tool call function")
        assert message["content"] == "" and call["function"]["arguments"] == "t0 t1 t2 "
    else:  # the fake text is no JSON list (required) and holds no <tool_call> (auto)
        assert message["tool_calls"] == [] and message["content"] == "t0 t1 t2 "


def test_chat_stream(urls):
    for options in (None, {}):
        body = {**CHAT, **({} if options is None else {"stream_options": options})}
        chunks = stream(urls[False], "/v1/chat/completions", body)
        if options is not None:
            *chunks, last = chunks
            keys(last, "last usage chunk")
            keys(last["usage"], "last usage")
        first, *rest = chunks
        keys(first, "chat first chunk")
        keys(first["choices"][0], "chat first chunk choice")
        keys(first["choices"][0]["delta"], "chat first delta")
        for chunk in rest:
            keys(chunk, "chat chunk")
            (choice,) = chunk["choices"]
            last_one = choice["finish_reason"] is not None
            keys(choice, "chat last chunk choice" if last_one else "chat chunk choice")
            keys(choice["delta"], "chat delta" if choice["delta"].get("content")
                 else "chat empty delta")
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
    continuous = stream(urls[True], "/v1/chat/completions", {
        **CHAT, "stream_options": {"continuous_usage_stats": True}})
    first, *rest, last = continuous
    assert set(first) == SHAPES["chat first chunk"] | {"usage"}
    for chunk in [first, *rest]:
        keys(chunk["usage"], "chat continuous usage")
    assert all(set(c) == SHAPES["chat chunk"] | {"usage"} for c in rest)
    keys(last["usage"], "usage")  # cached prompt tokens: the details too


def test_chat_stream_named_tool_call(urls):
    chunks = stream(urls[False], "/v1/chat/completions", {
        **CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    calls = [d for d in deltas if "tool_calls" in d]
    keys(calls[0], "chat tool delta")
    first, *more = [d["tool_calls"][0] for d in calls]
    keys(first, "streamed tool call")
    assert set(first["function"]) == {"name", "arguments"}
    for call in more:
        keys(call, "streamed tool call arguments")
        assert set(call["function"]) == {"arguments"}


def test_tokenize_detokenize_and_models(urls):
    url = urls[False]
    plain = post(url, "/tokenize", {"prompt": "Hello world"}).json()
    keys(plain, "tokenize")
    assert plain["token_strs"] is None  # vLLM sends the key, null
    strs = post(url, "/tokenize", {"messages": CHAT["messages"], "return_token_strs": True})
    keys(strs.json(), "tokenize")
    assert len(strs.json()["token_strs"]) == strs.json()["count"]
    keys(post(url, "/detokenize", {"tokens": plain["tokens"]}).json(), "detokenize")
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    keys(models, "model list")
    (card,) = models["data"]
    keys(card, "model card")
    (permission,) = card["permission"]
    keys(permission, "model permission")
    assert permission["object"] == "model_permission" and permission["allow_sampling"]


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {**PROMPT, "seed": 2**63}, 400),
    ("/v1/chat/completions", {**CHAT, "seed": "seven"}, 400),
    ("/v1/completions", {**PROMPT, "model": "nope"}, 404),
    ("/tokenize", {"prompt": "a", "messages": CHAT["messages"]}, 400),
])
def test_error_bodies(urls, path, body, status):
    r = post(urls[False], path, body)
    assert r.status_code == status
    keys(r.json(), "error")
    keys(r.json()["error"], "error info")
    assert r.json()["error"]["code"] == status


@pytest.mark.parametrize("seed, words", [
    (2**63, "{'type': 'less_than_equal', 'loc': 'body.seed', 'msg': 'Input should be less "
            "than or equal to 9223372036854775807', 'input': '9223372036854775808', 'ctx': "
            "{'le': 9223372036854775807}}"),
    (-(2**63) - 1, "{'type': 'greater_than_equal', 'loc': 'body.seed', 'msg': 'Input should "
                   "be greater than or equal to -9223372036854775808', 'input': "
                   "'-9223372036854775809', 'ctx': {'ge': -9223372036854775808}}"),
    ("seven", "{'type': 'int_parsing', 'loc': 'body.seed', 'msg': 'Input should be a valid "
              "integer, unable to parse string as an integer', 'input': 'seven'}"),
    ([7], "{'type': 'int_type', 'loc': 'body.seed', 'msg': 'Input should be a valid "
          "integer', 'input': '<list of 1 items>'}"),
])
def test_seed_errors_carry_pydantics_codes_as_vllms_400s(urls, seed, words):
    error = post(urls[False], "/v1/chat/completions", {**CHAT, "seed": seed}).json()["error"]
    assert error["message"] == f"1 validation error:\n  {words}", error
    assert error["param"] == "seed" and error["type"] == "BadRequestError"


def test_the_signed_64_bit_seed_range_is_accepted(urls):
    for seed in (-(2**63), -1, 2**63 - 1):
        r = post(urls[False], "/v1/completions", {**PROMPT, "seed": seed, "temperature": 1.0})
        assert r.status_code == 200, r.text


def test_many_validation_errors_are_counted_and_the_first_ten_shown(urls):
    error = post(urls[False], "/v1/completions", {**PROMPT, "stop": list(range(12))}).json()
    message = error["error"]["message"]
    assert message.startswith("13 validation errors:\n  {'type': 'string_type', 'loc': "
                              "'body.stop'")
    assert error["error"]["param"] == "stop"


def test_dropped_tokens_are_sent_as_vllms_minimum_and_top_minus_one_is_everything():
    """A processed logprobs mode's -inf (a dropped token) is valid JSON as -9999.0 (vLLM's
    value) in every logprobs object; chat's top_logprobs=-1 lists every alternative."""
    import json

    from jaxserve.entrypoints.openai.serving_chat import chat_logprobs
    from jaxserve.entrypoints.openai.serving_completion import (
        completion_logprobs,
        prompt_logprobs_json,
        prompt_part,
    )
    from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

    entry = {5: Logprob(-0.1, 1, "a"), 6: Logprob(float("-inf"), 2, "b"),
             7: Logprob(float("-inf"), 3, "c")}
    comp = CompletionOutput(0, "a", [5], logprobs=[entry])
    out = RequestOutput("r", "x", [9, 5], [comp], True, RequestMetrics(0.0),
                        prompt_logprobs=[None, entry])
    chat = chat_logprobs(comp, 0, -1, None)["content"][0]
    assert [t["logprob"] for t in chat["top_logprobs"]] == [-0.1, -9999.0, -9999.0]
    legacy = completion_logprobs(comp, 0, 0, None)
    assert legacy["top_logprobs"][0] == {"a": -0.1, "b": -9999.0, "c": -9999.0}
    tokenizer = type("Tok", (), {"decode": staticmethod(lambda ids: "?")})
    assert prompt_part(out, 2, tokenizer)["top_logprobs"][1] == {"a": -0.1, "b": -9999.0}
    assert prompt_logprobs_json(out)[1]["6"]["logprob"] == -9999.0
    for body in (chat, legacy, prompt_logprobs_json(out)):
        json.dumps(body, allow_nan=False)  # what the server's JSONResponse does

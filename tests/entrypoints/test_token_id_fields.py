"""vLLM's token-id request fields (`return_token_ids`, `return_tokens_as_token_ids` and the
server's `--return-tokens-as-token-ids`) through the official `openai` client, whole and
streamed, and pydantic's lax scalar coercion of request bodies, as vLLM's models do it."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import ServingLimits, build_app
from jaxserve.outputs import Logprob
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, running_server, sse_events
from tests.entrypoints.fake_engine import FakeEngine

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
IDS = {"return_token_ids": True, "return_tokens_as_token_ids": True}
COMPLETION = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
CHAT = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
            top_logprobs=2)


def token_id(label: str) -> int:
    """The id of a `token_id:N` label (what a client without the tokenizer does)."""
    assert label.startswith("token_id:"), label
    return int(label[len("token_id:"):])


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def plain(client):
    """A completion and a chat reply without the token-id fields: the rendering oracle (the
    same numbers up to float noise: a later request may read the prompt from the prefix
    cache)."""
    return client.completions.create(**COMPLETION), client.chat.completions.create(**CHAT)


def test_completion_ids_whole_and_streamed(client, plain, smollm2_tokenizer):
    tok, base = smollm2_tokenizer, plain[0].choices[0]
    assert base.prompt_token_ids is None and base.token_ids is None  # not asked: null (vLLM)
    got = client.completions.create(**COMPLETION, extra_body=IDS).choices[0]
    assert got.prompt_token_ids == tok.encode(PROMPT)
    assert got.text == base.text == tok.decode(got.token_ids)
    assert len(got.token_ids) == plain[0].usage.completion_tokens
    # token_id:N labels map back to the ids, with the plain response's numbers.
    assert [token_id(t) for t in got.logprobs.tokens] == got.token_ids
    assert got.logprobs.token_logprobs == pytest.approx(base.logprobs.token_logprobs, abs=1e-4)
    assert got.logprobs.text_offset == base.logprobs.text_offset
    for ids_top, text_top in zip(got.logprobs.top_logprobs, base.logprobs.top_logprobs,
                                 strict=True):
        assert {tok.decode([token_id(k)]): v for k, v in ids_top.items()} == pytest.approx(
            text_top, abs=1e-4)
    chunks = list(client.completions.create(**COMPLETION, stream=True, extra_body=IDS))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].prompt_token_ids == got.prompt_token_ids  # the first chunk only
    assert all(c.prompt_token_ids is None for c in choices[1:])
    streamed = [t for c in choices for t in c.token_ids]  # each chunk its new ids
    assert streamed == got.token_ids
    assert [token_id(t) for c in choices for t in c.logprobs.tokens] == streamed
    assert "".join(c.text for c in choices) == got.text


def test_echo_with_token_ids_gives_the_prompt_as_ids(client, plain, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(PROMPT)
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, echo=True,
                                    logprobs=1, temperature=0, extra_body=IDS).choices[0]
    assert got.prompt_token_ids == ids
    assert [token_id(t) for t in got.logprobs.tokens] == ids + got.token_ids
    assert got.logprobs.token_logprobs[0] is None
    # vLLM: with return_token_ids the echoed prompt comes as ids, not in the text.
    assert got.text == smollm2_tokenizer.decode(got.token_ids)
    assert plain[0].choices[0].text.startswith(got.text)


def test_chat_ids_whole_and_streamed(client, plain, smollm2_tokenizer):
    tok, base = smollm2_tokenizer, plain[1]
    assert base.prompt_token_ids is None and base.choices[0].token_ids is None
    template = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                            tokenize=True, return_dict=False))
    got = client.chat.completions.create(**CHAT, extra_body=IDS)
    assert got.prompt_token_ids == template
    choice, want = got.choices[0], base.choices[0]
    assert choice.message.content == want.message.content
    assert tok.decode(choice.token_ids, skip_special_tokens=True) == choice.message.content
    assert [token_id(e.token) for e in choice.logprobs.content] == choice.token_ids
    for entry, text_entry in zip(choice.logprobs.content, want.logprobs.content, strict=True):
        assert entry.logprob == pytest.approx(text_entry.logprob, abs=1e-4)
        assert entry.bytes == text_entry.bytes  # the token's own bytes, as vLLM
        assert [tok.decode([token_id(t.token)]) for t in entry.top_logprobs] == [
            t.token for t in text_entry.top_logprobs]
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
    chunks = list(client.chat.completions.create(**CHAT, stream=True, extra_body=IDS))
    assert chunks[0].prompt_token_ids == template  # the role chunk
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    assert "token_ids" not in chunks[0].choices[0].model_dump()
    later = [c.choices[0] for c in chunks[1:] if c.choices]
    streamed = [t for c in later for t in c.token_ids]
    assert streamed == choice.token_ids
    assert [token_id(e.token) for c in later for e in c.logprobs.content] == streamed
    assert "".join(c.delta.content or "" for c in later) == choice.message.content


def test_scalars_are_coerced_as_vllms_models_do(server, plain):
    """`"logprobs": "true"` and friends: pydantic's lax mode, as vLLM's request models."""
    chat = post(server, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": "5", "temperature": "0",
        "logprobs": "true", "top_logprobs": 2.0, "stream": "false"})
    assert chat.status_code == 200, chat.text
    choice, want = chat.json()["choices"][0], plain[1].choices[0]
    assert choice["message"]["content"] == want.message.content
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        e.token for e in want.logprobs.content]
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2
    completion = post(server, "/v1/completions", {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5.0, "temperature": 0,
        "logprobs": "2", "echo": 0, "return_token_ids": "yes"})
    assert completion.status_code == 200, completion.text
    choice = completion.json()["choices"][0]
    assert choice["text"] == plain[0].choices[0].text and len(choice["token_ids"]) == 5
    assert choice["logprobs"]["tokens"] == plain[0].choices[0].logprobs.tokens


@pytest.mark.parametrize("chat, extra, param, code", [
    (True, {"logprobs": "maybe"}, "logprobs", "bool_parsing"),
    (True, {"top_logprobs": "two", "logprobs": True}, "top_logprobs", "int_parsing"),
    (True, {"messages": [{"role": 5, "content": "x"}]}, "messages.0.role", "string_type"),
    (False, {"max_tokens": 1.5}, "max_tokens", "int_from_float"),
    (False, {"stream": 2}, "stream", "bool_parsing"),
    (False, {"n": "2x"}, "n", "int_parsing"),
    (False, {"temperature": "warm"}, "temperature", "float_parsing"),
    (False, {"stream": True, "stream_options": {"include_usage": "maybe"}},
     "stream_options.include_usage", "bool_parsing"),
    (False, {"cache_salt": 5}, "cache_salt", "string_type"),
    (False, {"return_token_ids": "maybe"}, "return_token_ids", "bool_parsing"),
    (True, {"return_tokens_as_token_ids": [True]}, "return_tokens_as_token_ids", "bool_type"),
])
def test_values_that_do_not_parse_are_still_400s(server, chat, extra, param, code):
    body = {"model": MODEL_NAME, "max_tokens": 1, **(
        {"messages": MESSAGES} if chat else {"prompt": PROMPT}), **extra}
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and f"'type': '{code}'" in error["message"], error


class LogprobEngine(FakeEngine):
    """The fake engine (token i as text `"t{i} "`) with logprobs when asked for: the token
    (rank 1) and id i + 100 (rank 2, text `"u{i}"`); a finished completion carries routed
    experts (`ROUTED` cut to its positions), as an engine capturing routing."""

    def step(self):
        params = {rid: entry[1] for rid, entry in self.running.items()}
        outputs = super().step()
        for out in outputs:
            for comp in out.outputs:
                if params[out.request_id].logprobs is not None:
                    comp.logprobs = [{t: Logprob(-0.5, 1, f"t{t} "),
                                      t + 100: Logprob(-2.0, 2, f"u{t}")}
                                     for t in comp.token_ids]
                if comp.finish_reason is not None:
                    n = len(out.prompt_token_ids) + len(comp.token_ids) - 1
                    comp.routed_experts = ROUTED[:n]
        return outputs


ROUTED = np.arange(64 * 3 * 2, dtype=np.int32).reshape(64, 3, 2) % 7  # [position, L, k]


@pytest.fixture(scope="module")
def flagged(smollm2_tokenizer):
    """A server started with `--return-tokens-as-token-ids` (and `--reasoning-parser qwen3`)
    over the fake engine: rendering only, nothing to compile."""
    engine = LogprobEngine(step_seconds=0.002)
    engine.tokenizer = smollm2_tokenizer  # for the chat template and text prompts
    engine.limits.max_model_len = 256
    llm = AsyncLLM(engine, log_interval=0)
    app = build_app(llm, ["fake"], limits=ServingLimits(return_tokens_as_token_ids=True,
                                                        reasoning_parser="qwen3"))
    try:
        with running_server(app) as (_, url):
            yield url
    finally:
        llm.shutdown()


def fake_post(url: str, path: str, body: dict, stream: bool = False):
    """The response body, or a stream's events without `[DONE]`."""
    if not stream:
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


FAKE = {"model": "fake", "max_tokens": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_server_flag_renders_tokens_as_ids_unless_the_request_says_no(flagged, stream):
    body = {**FAKE, "prompt": "Hello", "logprobs": 1}

    def tokens(request):
        got = fake_post(flagged, "/v1/completions", request, stream)
        parts = [e["choices"][0]["logprobs"] for e in got] if stream else \
            [got["choices"][0]["logprobs"]]
        return ([t for p in parts for t in p["tokens"]],
                [k for p in parts for top in p["top_logprobs"] for k in top])

    assert tokens(body) == (["token_id:0", "token_id:1", "token_id:2"], [
        "token_id:0", "token_id:100", "token_id:1", "token_id:101", "token_id:2",
        "token_id:102"])
    assert tokens({**body, "return_tokens_as_token_ids": False})[0] == ["t0 ", "t1 ", "t2 "]
    chat = {**FAKE, "messages": MESSAGES, "logprobs": True, "top_logprobs": 1}
    got = fake_post(flagged, "/v1/chat/completions", chat, stream)
    content = [e for c in got[1:] for e in c["choices"][0]["logprobs"]["content"]] if stream \
        else got["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["token_id:0", "token_id:1", "token_id:2"]
    assert [e["bytes"] for e in content] == [list(b"t0 "), list(b"t1 "), list(b"t2 ")]
    assert [t["token"] for e in content for t in e["top_logprobs"]] == [
        "token_id:0", "token_id:1", "token_id:2"]
    assert content[0]["top_logprobs"][0]["bytes"] == list(b"token_id:0")  # vLLM's
    off = fake_post(flagged, "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": 0})
    assert off["choices"][0]["logprobs"]["content"][0]["token"] == "t0 "


def test_streamed_echo_and_n_choices_carry_their_ids(flagged):
    chunks = fake_post(flagged, "/v1/completions", {
        **FAKE, "prompt": "Hello", "echo": True, "return_token_ids": True}, stream=True)
    first, *rest = [c["choices"][0] for c in chunks]
    assert first["text"] == "t0 "  # the echoed prompt comes as ids (vLLM), not as text
    assert first["prompt_token_ids"] == [1, 2]  # the fake engine's prompt ids
    assert all(c["prompt_token_ids"] is None for c in rest)
    assert [t for c in [first, *rest] for t in c["token_ids"]] == [0, 1, 2]
    chunks = fake_post(flagged, "/v1/chat/completions", {
        **FAKE, "messages": MESSAGES, "n": 2, "return_token_ids": True}, stream=True)
    # vLLM sends the prompt's ids with each choice's role chunk (the fake engine itself
    # generates choice 0 only).
    roles = [c for c in chunks if "prompt_token_ids" in c]
    assert [c["choices"][0]["index"] for c in roles] == [0, 1] and roles == chunks[:2]
    assert roles[0]["prompt_token_ids"] == roles[1]["prompt_token_ids"] != []
    assert [t for c in chunks[2:] for t in c["choices"][0]["token_ids"]] == [0, 1, 2]


@pytest.mark.parametrize("stream", [False, True])
def test_ids_are_withheld_when_reasoning_is_left_out(flagged, stream):
    """`include_reasoning: false` with a reasoning parser: the output ids would show the
    hidden reasoning, so vLLM sends none (the prompt's ids still come)."""
    body = {**FAKE, "messages": MESSAGES, "return_token_ids": True,
            "include_reasoning": False}
    got = fake_post(flagged, "/v1/chat/completions", body, stream)
    if stream:
        assert got[0]["prompt_token_ids"]
        assert all(c["choices"][0]["token_ids"] is None for c in got[1:])
    else:
        assert got["prompt_token_ids"] and got["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_routed_experts_reach_the_client(flagged, stream):
    """An engine capturing routing (`--enable-return-routed-experts`): each finished choice
    carries its routed experts as [position][layer][k] lists (streamed: in its last
    chunk), chat and completions."""
    for path, body in (("/v1/chat/completions", {**FAKE, "messages": MESSAGES}),
                       ("/v1/completions", {**FAKE, "prompt": "Hello"})):
        got = fake_post(flagged, path, {**body, "return_token_ids": True}, stream)
        if stream:
            ends = [c["choices"][0] for c in got if c["choices"]
                    and c["choices"][0]["finish_reason"] is not None]
            assert len(ends) == 1
            assert all("routed_experts" not in c["choices"][0] or c["choices"][0] is ends[0]
                       for c in got if c["choices"])
            choice = ends[0]
        else:
            choice = got["choices"][0]
            assert got.get("prompt_token_ids", choice.get("prompt_token_ids")) == [1, 2]
        # The fake engine's prompt is [1, 2] whatever was sent.
        assert choice["routed_experts"] == ROUTED[:2 + FAKE["max_tokens"] - 1].tolist(), path

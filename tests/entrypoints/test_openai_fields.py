"""Request fields existing OpenAI/vLLM clients send: usage details (prefix-cache hits, per-chunk
usage), any signed 64-bit seed (pydantic's codes and wording outside, as vLLM's 400s), and
bad structured-output and tool fields (or ones that would change the output but are not
supported) refused with a 400 naming them, never silently ignored."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {**GOOD, "response_format": {"type": "xml"}}, "response_format",
     "type must be"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "does not compile"),
    ("/v1/completions", {**GOOD, "guided_json": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}, "guided_json", "does not exist"),
    ("/v1/completions", {**GOOD, "guided_json": {"type": "string", "format": "no-such"}},
     "guided_json", "Unknown format"),
    ("/v1/completions", {**GOOD, "guided_regex": "[a-z"}, "guided_regex", "does not compile"),
    ("/v1/completions", {**GOOD, "guided_grammar": "start: missing_rule"}, "guided_grammar",
     "does not compile"),
    ("/v1/chat/completions", {**CHAT, "guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regexp": "a+"}},
     "structured_outputs", "unknown field"),
    ("/v1/completions", {**GOOD, "response_format": {"type": "json_object"},
                         "guided_regex": "a+"}, "guided_regex", "one output constraint"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}],
        "tool_choice": "required"}, "tools", "does not compile"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice",
     "one output constraint"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "nope"}}]}, "tools", "JSON schema object"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "not in tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": "get_weather"}}, "tool_choice", "'function' object"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": "f"}],
                              "tool_choice": "none"}, "tools", "'function' object"),
    ("/v1/chat/completions", {**CHAT, "functions": [TOOL["function"]]}, "functions",
     "deprecated"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}},
     "stream_options", "stream is true"),
    ("/v1/chat/completions", {**CHAT, "stream": False, "stream_options": {
        "include_usage": True}}, "stream_options", "stream is true"),
    ("/v1/completions", {**GOOD, "seed": -(2**63) - 1}, "seed",
     "'type': 'greater_than_equal', 'loc': 'body.seed', 'msg': 'Input should be greater than "
     "or equal to -9223372036854775808'"),
    ("/v1/completions", {**GOOD, "seed": 2**63}, "seed",
     "'type': 'less_than_equal', 'loc': 'body.seed', 'msg': 'Input should be less than or "
     "equal to 9223372036854775807'"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "seed", "less than or equal"),
])
def test_unsupported_or_out_of_range_fields_are_400s_naming_them(server, path, body, param,
                                                                 words):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_largest_seed_and_text_response_format_are_accepted(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, seed=2**63 - 1,
                                  temperature=1.0, extra_body={"response_format": {
                                      "type": "text"}})
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("seed", [-(2**63), -1, 2**32 + 5])
def test_any_signed_64_bit_seed_samples_deterministically(client, seed):
    # n=2: completion 1's stream is derived from the seed's 64 bits (negative ones too).
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, temperature=1.0, n=2,
              seed=seed)
    first, again = (client.completions.create(**kw) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert all(c.finish_reason == "length" for c in first.choices)


def test_tools_can_be_shown_with_tool_choice_none(client):
    # SmolLM2's own template ignores tools; this one lists them before the messages.
    template = ("{% for t in tools or [] %}tool: {{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    kw = dict(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=2, temperature=0,
              extra_body={"chat_template": template})
    with_tools = client.chat.completions.create(tools=[TOOL], tool_choice="none", **kw)
    plain = client.chat.completions.create(**kw)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # tools were rendered
    assert with_tools.choices[0].message.tool_calls == []  # vLLM's empty list


def test_cached_tokens_count_prefix_cache_hits(client, server):
    # The shared server runs with --enable-prompt-tokens-details; as vLLM, the details come
    # only when some prompt tokens were cached.
    prefix = "Shared system prompt for the cached-token test: " + "alpha beta gamma " * 12
    first = client.completions.create(model=MODEL_NAME, prompt=prefix + "first", max_tokens=1,
                                      temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prefix + "second",
                                       max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details is None
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole 16-token pages of the shared prefix are served from the cache.
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_give_usage_on_every_chunk(client, chat):
    kw = dict(model=MODEL_NAME, max_tokens=5, temperature=0, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=CHAT["messages"], **kw))
    else:
        chunks = list(client.completions.create(prompt="Once upon a time", **kw))
    assert all(c.usage is not None for c in chunks)
    prompt = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt) == 1
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 5
    assert chunks[-1].choices == []  # the final usage chunk is still sent
    total = chunks[-1].usage
    assert total.total_tokens == total.prompt_tokens + 5


def test_include_usage_alone_puts_usage_on_the_last_chunk_only(client):
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_openai_client_gets_the_stream_options_400(client):
    # The official client sends stream_options only with stream=True; a non-stream call
    # with it is answered with the 400 above.
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1,
                                  stream_options={"include_usage": True})


def test_invocations_route_by_body(client, server):
    chat = {**CHAT, "temperature": 0}
    via = post(server, "/invocations", chat).json()
    direct = post(server, "/v1/chat/completions", chat).json()
    assert via["object"] == "chat.completion"
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]
    via = post(server, "/invocations", GOOD).json()
    assert via["object"] == "text_completion"
    assert via["choices"][0]["text"] == post(server, "/v1/completions", GOOD).json()[
        "choices"][0]["text"]
    r = post(server, "/invocations", {"model": MODEL_NAME, "input": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert post(server, "/invocations", [1]).status_code == 400
    r = httpx.post(f"{server.url}/invocations", json=GOOD, timeout=30)  # no key
    assert r.status_code == 401


def test_tokenize_renders_tools_and_template(server):
    template = ("{% for t in tools or [] %}tool: {{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    body = {"messages": CHAT["messages"], "chat_template": template}
    plain = post(server, "/tokenize", body).json()
    tools = post(server, "/tokenize", {**body, "tools": [TOOL], "return_token_strs": True})
    assert tools.json()["count"] > plain["count"]
    assert "weather" in "".join(tools.json()["token_strs"])
    r = post(server, "/tokenize", {**body, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_load_and_tokenizer_info_behind_their_flags(server, smollm2_tokenizer):
    import threading

    from jaxserve.entrypoints.openai.api_server import build_app
    from tests.entrypoints.conftest import running_server, wait_for

    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    assert httpx.get(f"{server.url}/tokenizer_info", headers=AUTH).status_code == 404
    app = build_app(server.llm, [MODEL_NAME], api_key=API_KEY, shutdown_engine=False,
                    enable_server_load_tracking=True, enable_tokenizer_info_endpoint=True)
    with running_server(app) as (_, url):
        info = httpx.get(f"{url}/tokenizer_info", headers=AUTH).json()
        assert info["eos_token"] == smollm2_tokenizer.eos_token and info["chat_template"]
        assert info["model_max_length"] == 256 and info["vocab_size"] == 49152
        assert httpx.get(f"{url}/tokenizer_info").status_code == 401  # keyed
        started = threading.Event()
        seen = []

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=120,
                              json={**GOOD, "max_tokens": 40, "ignore_eos": True,
                                    "stream": True}) as r:
                for _ in r.iter_lines():
                    if not started.is_set():
                        seen.append(httpx.get(f"{url}/load").json()["server_load"])
                        started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(120)
        thread.join(120)
        assert seen == [1]
        # NOTE: the count drops when the response ends on the server, which may come just
        # after the client has read its last line.
        assert wait_for(lambda: httpx.get(f"{url}/load").json() == {"server_load": 0}, 30)


CONTEXT, CONTINUATION = "The capital of France is", " Paris"


@pytest.fixture(scope="module")
def offline_llm(smollm2, smollm2_tokenizer):
    """`LLM` over the same model and limits as the server (the offline API as an oracle)."""
    from jaxserve import LLM
    from tests.entrypoints.conftest import LIMITS

    # NOTE: the server's pool size too, so its programs come from the compilation cache.
    return LLM(smollm2, tokenizer=smollm2_tokenizer, num_kv_blocks=64, warmup=False,
               **LIMITS)


def test_echo_scores_the_prompt_like_an_evaluation_harness(client, server, hf_smollm2,
                                                           smollm2_tokenizer, torch_one_thread,
                                                           offline_llm):
    """lm-evaluation-harness's loglikelihood: echo=True, max_tokens=0, logprobs=1, then the
    sum of the continuation's token logprobs; checked against transformers and against
    `LLM.generate`'s prompt logprobs."""
    import torch

    from jaxserve import SamplingParams

    r = client.completions.create(model=MODEL_NAME, prompt=CONTEXT + CONTINUATION,
                                  max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == CONTEXT + CONTINUATION  # the prompt only: nothing generated
    assert r.usage.completion_tokens == 0
    lp = choice.logprobs
    ids = smollm2_tokenizer.encode(CONTEXT + CONTINUATION)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0], -1).numpy()
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - ref[pos - 1, ids[pos]]) < 1e-3
        assert len(lp.top_logprobs[pos]) <= 2  # the token and the top 1
    n_ctx = len(smollm2_tokenizer.encode(CONTEXT))
    score = sum(lp.token_logprobs[n_ctx:])
    want = sum(ref[p - 1, ids[p]] for p in range(n_ctx, len(ids)))
    assert abs(score - want) < 1e-3
    (offline,) = offline_llm.generate([CONTEXT + CONTINUATION], SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert offline.prompt_token_ids == ids
    for pos in range(1, len(ids)):
        assert abs(offline.prompt_logprobs[pos][ids[pos]].logprob
                   - lp.token_logprobs[pos]) < 1e-4
    # The same numbers through vLLM's prompt_logprobs field.
    raw = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": CONTEXT + CONTINUATION,
                                           "max_tokens": 1, "temperature": 0,
                                           "prompt_logprobs": 0}).json()
    plp = raw["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert all(abs(plp[p][str(ids[p])]["logprob"] - lp.token_logprobs[p]) < 1e-5
               for p in range(1, len(ids)))


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_generation_puts_prompt_then_output_logprobs(client, stream):
    kw = dict(model=MODEL_NAME, prompt=CONTEXT, max_tokens=3, echo=True, logprobs=2,
              temperature=0)
    plain = client.completions.create(model=MODEL_NAME, prompt=CONTEXT, max_tokens=3,
                                      logprobs=2, temperature=0).choices[0]
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
                  for t in c.choices[0].logprobs.token_logprobs]
        offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
                   for o in c.choices[0].logprobs.text_offset]
    else:
        choice = client.completions.create(**kw).choices[0]
        text, tokens = choice.text, choice.logprobs.token_logprobs
        offsets = choice.logprobs.text_offset
    assert text == CONTEXT + plain.text
    n = len(tokens) - 3
    assert tokens[0] is None and all(t is not None for t in tokens[1:])
    assert tokens[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert offsets == sorted(offsets) and offsets[n] == len(CONTEXT)


def test_echo_only_streams_the_prompt_once(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=CONTEXT, max_tokens=0,
                                            echo=True, stream=True, temperature=0))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == CONTEXT and chunks[-1].choices[0].finish_reason == "length"
    counted = list(client.completions.create(
        model=MODEL_NAME, prompt=CONTEXT, max_tokens=0, echo=True, stream=True,
        temperature=0, stream_options={"include_usage": True,
                                       "continuous_usage_stats": True}))
    assert {c.usage.completion_tokens for c in counted} == {0}  # nothing generated


def test_chat_returns_prompt_logprobs_when_asked(server):
    r = post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 1}).json()
    plp = r["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
    assert all(len(e) >= 1 for e in plp[1:])
    assert post(server, "/v1/chat/completions", CHAT).json()["prompt_logprobs"] is None  # vLLM


@pytest.mark.parametrize("field, value", [
    ("length_penalty", 0.5), ("truncate_prompt_tokens", 4), ("logits_processors", ["x"]),
])
def test_vllm_extras_not_built_yet_are_refused_not_ignored(server, field, value):
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        r = post(server, path, {**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # Their neutral values are accepted (clients that always send them keep working).
    neutral = {"length_penalty": 1.0}.get(field)
    assert post(server, "/v1/completions", {**GOOD, field: neutral}).status_code == 200


def test_the_field_table_lists_every_field_the_server_parses():
    import re
    from pathlib import Path

    from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from jaxserve.entrypoints.openai.protocol_responses import ResponsesRequest
    from jaxserve.entrypoints.openai.serving_embedding import EmbeddingRequest
    from jaxserve.entrypoints.openai.serving_score import (
        ClassificationRequest,
        RerankRequest,
        ScoreRequest,
    )

    doc = (Path(__file__).parents[2] / "docs" / "openai_api.md").read_text()
    rows, header = [], None  # the first cells of the tables headed `| field |`
    for line in doc.splitlines():
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = line.split("|")[1].strip()
        elif header == "field" and line.startswith("| `"):
            rows.append(line.split("|")[1])
    listed = {name for cell in rows for name in re.findall(r"`([a-z_][a-z0-9_]*)`", cell)}
    parsed = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
              | set(EmbeddingRequest.model_fields) | set(ResponsesRequest.model_fields)
              | set(ScoreRequest.model_fields) | set(RerankRequest.model_fields)
              | set(ClassificationRequest.model_fields))
    assert parsed - listed == set()
    assert listed - parsed == set()


def test_metrics_have_vllms_request_and_step_families(server):
    assert post(server, "/v1/completions", {**GOOD, "n": 2, "temperature": 1.0}).status_code \
        == 200
    m = server.metrics()
    info = [k for k in m if k.startswith("jaxserve:cache_config_info{")]
    assert info == ["jaxserve:cache_config_info{block_size=16,cache_dtype=auto,"
                    "enable_prefix_caching=True,gpu_memory_utilization=0.9,num_gpu_blocks=64,"
                    "swap_space=4.0}"], info
    assert m["jaxserve:iteration_tokens_total_count"] > 0
    assert m["jaxserve:request_params_n_sum"] >= 2
    for name in ("request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert m[f"jaxserve:{name}_count"] > 0, name


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_and_whole_agree_with_n_two(client, chat):
    kw = dict(model=MODEL_NAME, max_tokens=6, n=2, temperature=1.0, seed=11)
    if chat:
        full = client.chat.completions.create(messages=CHAT["messages"], **kw)
        chunks = list(client.chat.completions.create(messages=CHAT["messages"], stream=True,
                                                     **kw))
        whole = {c.index: (c.message.content, c.finish_reason) for c in full.choices}
        text = lambda c: c.delta.content or ""
    else:
        full = client.completions.create(prompt="Once upon a time", **kw)
        chunks = list(client.completions.create(prompt="Once upon a time", stream=True, **kw))
        whole = {c.index: (c.text, c.finish_reason) for c in full.choices}
        text = lambda c: c.text
    streamed = {}
    for chunk in chunks:
        for c in chunk.choices:
            got, reason = streamed.get(c.index, ("", None))
            streamed[c.index] = (got + text(c), c.finish_reason or reason)
    assert sorted(whole) == [0, 1] and streamed == whole
    assert whole[0][0] != whole[1][0]


def test_logit_controls_over_http(client, smollm2_tokenizer):
    steered = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                        max_tokens=3, temperature=0, logit_bias={"28": 100})
    assert steered.choices[0].text == smollm2_tokenizer.decode([28, 28, 28])
    allowed = [28, 260]
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4,
                                  temperature=1.0, seed=3, logprobs=0,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    texts = {smollm2_tokenizer.decode([t]) for t in allowed}
    assert set(r.choices[0].logprobs.tokens) <= texts
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"],
                                          max_tokens=2, temperature=0,
                                          logit_bias={"28": 100})
    assert chat.choices[0].message.content == smollm2_tokenizer.decode([28, 28])


def test_beam_search_over_http_equals_llm_beam_search(client, offline_llm):
    from jaxserve.engine.beam_search import BeamSearchParams

    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, n=3,
                                  extra_body={"use_beam_search": True})
    (want,) = offline_llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
    assert [c.text for c in r.choices] == [s.text for s in want.sequences]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(
        len(s.tokens) - s.num_prompt_tokens for s in want.sequences)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"],
                                          max_tokens=4, n=2,
                                          extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content


@pytest.mark.parametrize("extra, words", [
    ({"stream": True}, "does not stream"), ({"n": 11}, "beam width"),
    ({"logprobs": 2}, "logprobs"), ({"length_penalty": "x"}, "length_penalty"),
    ({"stop": ["x"]}, "stop is not supported"), ({"temperature": 0.7}, "temperature"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"min_tokens": 2}, "min_tokens"),
])
def test_beam_search_refuses_what_it_cannot_do(server, extra, words):
    r = post(server, "/v1/completions", {**GOOD, "use_beam_search": True, **extra})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text

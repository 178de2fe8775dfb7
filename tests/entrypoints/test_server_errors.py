"""Bad requests over raw HTTP: status, OpenAI error body naming the field, server keeps serving;
a client leaving mid-stream frees its pages; `/metrics` parses and its counters move."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME, sse_events

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def post(server, path, body=None, headers=AUTH, content=None):
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=headers,
                      timeout=120)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": "high"}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("/v1/completions", {**GOOD, "stop": 3}, 400, "stop"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": "word " * 300}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "max_tokens": 250, "prompt": "word " * 20}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x " * 300}]},
     400, "messages"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
])
def test_bad_request_gets_an_openai_error_naming_the_field(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status and error["message"]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {**GOOD, "logprobs": -1}, "logprobs",
     "`logprobs` must be a positive value."),
    ("/v1/completions", {**GOOD, "logprobs": 21}, "logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("/v1/completions", {**GOOD, "prompt_logprobs": -2}, "prompt_logprobs",
     "`prompt_logprobs` must be a positive value or -1."),
    ("/v1/completions", {**GOOD, "prompt_logprobs": -1}, "prompt_logprobs",
     "Requested prompt logprobs of 49152, which is greater than max allowed: 20"),
    ("/v1/completions", {**GOOD, "echo": True, "logprobs": 2, "prompt_logprobs": -1},
     "prompt_logprobs",
     "Requested prompt logprobs of 49152, which is greater than max allowed: 20"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "logprobs",
     "Requested sample logprobs of 49152, which is greater than max allowed: 20"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -2}, "top_logprobs",
     "`top_logprobs` must be a positive value or -1."),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 21}, "prompt_logprobs",
     "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
])
def test_logprobs_limits_are_vllms_400s(server, path, body, param, message):
    """vLLM's rules and words: -1 (the whole vocabulary) where vLLM takes it, checked with
    the rest against the engine's max_logprobs (the default 20)."""
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)


def test_bad_json_is_a_400(server):
    r = post(server, "/v1/chat/completions", content=b'{"model": "x", "messages": [',
             headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY}])
def test_missing_or_wrong_api_key_is_a_401(server, headers):
    r = post(server, "/v1/completions", GOOD, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # not behind the key


def test_unknown_route_is_an_openai_404(server):
    r = httpx.get(f"{server.url}/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_server_keeps_serving_after_errors(server):
    for body in ({**GOOD, "max_tokens": -1}, {**GOOD, "model": "x"}):
        assert post(server, "/v1/completions", body).status_code in (400, 404)
    r = post(server, "/v1/completions", GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    events = sse_events(post(server, "/v1/completions", {**GOOD, "stream": True}))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_client_leaving_mid_stream_aborts_and_frees_pages(server):
    before = server.wait_idle()
    aborted = before.get("jaxserve:request_success_total{finished_reason=abort}", 0)
    body = {**GOOD, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http, \
            http.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                busy = server.metrics()
                break
    assert busy["jaxserve:num_requests_running"] == 1
    assert busy["jaxserve:kv_cache_usage_perc"] > 0
    after = server.wait_idle(timeout=30)
    assert after["jaxserve:num_requests_running"] == 0
    assert after["jaxserve:kv_cache_usage_perc"] == 0
    assert after["jaxserve:request_success_total{finished_reason=abort}"] == aborted + 1
    key = "jaxserve:generation_tokens_total"
    assert after[key] - before[key] < 100  # stopped long before max_tokens


def test_client_timing_out_on_a_whole_response_aborts_it(server):
    before = server.wait_idle()
    aborted = before.get("jaxserve:request_success_total{finished_reason=abort}", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=1.5,
                   json={**GOOD, "max_tokens": 200, "ignore_eos": True})
    after = server.wait_idle(timeout=30)
    assert after["jaxserve:kv_cache_usage_perc"] == 0
    assert after["jaxserve:request_success_total{finished_reason=abort}"] == aborted + 1


def test_metrics_parse_and_counters_move(server):
    before = server.wait_idle()
    assert post(server, "/v1/completions", {**GOOD, "max_tokens": 3}).status_code == 200
    after = server.wait_idle()
    grew = lambda name, by: after[name] - before.get(name, 0) == by
    assert grew("jaxserve:prompt_tokens_total", 1)  # "Hello" is one token
    assert grew("jaxserve:generation_tokens_total", 3)
    # vLLM's iteration count: the prompt with the first token, then each new token
    assert grew("jaxserve:iteration_tokens_total_sum", 1 + 3)
    assert grew("jaxserve:request_success_total{finished_reason=stop}", 0)  # there from 0
    assert grew("jaxserve:request_success_total{finished_reason=length}", 1)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert grew(f"jaxserve:{hist}_count", 1), hist
    assert grew("jaxserve:inter_token_latency_seconds_count", 2)
    assert grew("jaxserve:prefix_cache_queries_total", 1)
    for gauge in ("num_requests_waiting", "num_requests_swapped", "num_preemptions_total",
                  "prefix_cache_hits_total", "num_compilations", "padding_waste_ratio"):
        assert f"jaxserve:{gauge}" in after, gauge
    # NOTE: a delta: the engine's compile counter is process-wide, and other engines of this
    # test session compile their own buckets.
    assert grew("jaxserve:num_compilations", 0)  # warm-up covered every bucket

"""Issue 50's limits over a fake engine with the real tokenizer: the /tokenize cap and memory
after maximal bodies, the heavy preparation lane (queued, then a 429 naming the limit, while
small requests pass), the stop-string cap, duplicate Authorization headers, the docs flag."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import httpx
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.cli import build_parser
from jaxserve.entrypoints.cli.serve import run as serve_run
from jaxserve.entrypoints.openai.admission import PrepareLanes, PrepareLimits
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.serving_base import ServingLimits
from tests.entrypoints.conftest import API_KEY, running_server
from tests.entrypoints.test_run_batch_resume import CountingEngine

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CAP = 512  # --max-tokenize-tokens of the test server (the fake engine's max_model_len is 64)
HEAVY_BYTES = 64 * 1024
MAX_BODY = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def served(smollm2_tokenizer):
    """(url, app) of a server over the fake engine: one heavy worker, one heavy queue slot."""
    llm = AsyncLLM(CountingEngine(smollm2_tokenizer, step_seconds=0.002), log_interval=0)
    app = build_app(llm, ["fake"], api_key=API_KEY,
                    limits=ServingLimits(max_tokenize_tokens=CAP, max_stop_strings=4),
                    prepare_limits=PrepareLimits(heavy_body_bytes=HEAVY_BYTES, heavy_workers=1,
                                                 heavy_queue=1, heavy_share=1.0))
    try:
        with running_server(app) as (_, url):
            yield url, app
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def test_tokenize_caps_its_tokens_and_names_the_limit(served):
    url, _ = served
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        ok = c.post("/tokenize", json={"prompt": " ".join(["hello"] * CAP)}).json()
        assert ok["count"] == len(ok["tokens"]) == CAP  # at the limit: answered
        over = c.post("/tokenize", json={"prompt": " ".join(["hello"] * (CAP + 10))})
        assert over.status_code == 400
        error = over.json()["error"]
        assert error["param"] == "prompt" and f"limit of {CAP} tokens" in error["message"]
        assert "--max-tokenize-tokens" in error["message"]
        assert f"tokenizes to {CAP + 10}" in error["message"]  # the value
        huge = c.post("/tokenize", json={"prompt": "x" * 7_000_000})
        assert huge.status_code == 400 and "7000000 characters" in huge.json()["error"]["message"]
        chat = c.post("/tokenize", json={"messages": [{"role": "user",
                                                        "content": "hi " * (CAP + 10)}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        detok = c.post("/detokenize", json={"tokens": [1] * (CAP + 1)})
        assert detok.status_code == 400 and detok.json()["error"]["param"] == "tokens"
        assert f"holds {CAP + 1}" in detok.json()["error"]["message"]
        assert c.post("/detokenize", json={"tokens": [1] * CAP}).status_code == 200


def test_six_concurrent_maximal_tokenize_bodies_leave_memory_as_it_was(served):
    url, _ = served
    # The largest body the server reads, and the longest text the cap lets through to the
    # tokenizer (81 characters per token at most), in emoji: two tokens each.
    largest = b'{"prompt": "' + b"hello " * ((MAX_BODY - 64) // 6) + b'"}'
    longest = ('{"prompt": "' + "\U0001f642" * (81 * CAP) + '"}').encode()
    before = _rss_mb()
    for body in (largest, longest):
        def post(_, body=body):
            return httpx.post(f"{url}/tokenize", content=body, timeout=120,
                              headers={**AUTH, "Content-Type": "application/json"})

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(post, range(6)))
        # Bodies over 64 KiB go through the heavy lane: one at a time, one waiting, 429s.
        assert {r.status_code for r in answers} <= {400, 429}, [r.text for r in answers]
        assert sum(r.status_code == 400 for r in answers) >= 2
        for r in answers:
            assert r.json()["error"]["code"] == r.status_code
    del largest, longest, answers
    after = _rss_mb()
    print(f"RSS {before:.0f} MB before six maximal /tokenize bodies (twice), {after:.0f} "
          "MB after")
    assert after - before < 100


def test_heavy_lane_queues_then_refuses_while_small_requests_pass(served, client):
    url, app = served
    lanes, loop, release = app.state.lanes, app.state.loop, threading.Event()
    # Occupy the heavy worker and its one queue slot with calls that wait for `release`.
    held = [asyncio.run_coroutine_threadsafe(lanes.run(True, release.wait), loop)
            for _ in range(2)]
    try:
        deadline = time.time() + 10
        while lanes.heavy_admitted < 2 and time.time() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_body={"chat_template": "{{ messages[0]['content'] }}"})
        message = refused.value.body["message"]
        assert "the limit is 2" in message and "--heavy-prepare-queue" in message
        big = httpx.post(f"{url}/tokenize", json={"prompt": "a " * HEAVY_BYTES}, headers=AUTH,
                         timeout=60)
        assert big.status_code == 429 and big.json()["error"]["type"] == "RateLimitError"
        start = time.perf_counter()
        out = client.completions.create(model="fake", prompt="Hello", max_tokens=2)
        assert out.choices[0].text == "t0 t1 " and time.perf_counter() - start < 5
    finally:
        release.set()
        for f in held:
            f.result(10)
    assert lanes.heavy_admitted == 0
    own = client.chat.completions.create(model="fake", max_tokens=2,
                                         messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"chat_template": "{{ 'x' }}"})
    assert own.choices[0].message.content == "t0 t1 "  # admitted again once the lane frees


def test_lanes_bound_heavy_calls_and_count_them_back():
    async def scenario():
        lanes = PrepareLanes(PrepareLimits(heavy_workers=1, heavy_queue=0))
        gate = threading.Event()
        first = asyncio.ensure_future(lanes.run(True, gate.wait))
        await asyncio.sleep(0.05)
        with pytest.raises(OpenAIError) as e:
            await lanes.run(True, lambda: None)
        assert e.value.status == 429 and "the limit is 1 (1 workers + 0 queued" in e.value.message
        assert await lanes.run(False, lambda: 7) == 7  # the light lane is not held up
        gate.set()
        await first
        with pytest.raises(ZeroDivisionError):
            await lanes.run(True, lambda: 1 / 0)  # a failing call is counted back too
        assert (lanes.heavy_admitted, lanes.heavy_refused) == (0, 1)
        lanes.shutdown()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="heavy_workers must be at least 1, got 0"):
        PrepareLimits(heavy_workers=0)
    for name in ("max_tokenize_tokens", "max_stop_strings"):
        with pytest.raises(ValueError, match=f"^{name} must be at least 1, got 0$"):
            ServingLimits(**{name: 0})
    with pytest.raises(ValueError, match=r"heavy_share must be in \(0, 1\], got 0"):
        PrepareLimits(heavy_share=0)


@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "\\ud800"}', "prompt: text holds a lone surrogate"),
    (b'{"prompt": "\xed\xa0\x80"}', "prompt: text holds a lone surrogate"),
    ('{"prompt": "\ud800"}'.encode("utf-16-le", "surrogatepass"),
     "prompt: text holds a lone surrogate"),
])
def test_parsing_still_finds_lone_surrogates_when_it_skips_the_re_encoding(body, message):
    from jaxserve.entrypoints.openai.errors import parse_body
    from jaxserve.entrypoints.openai.protocol import TokenizeRequest

    with pytest.raises(OpenAIError, match=message):
        parse_body(body, TokenizeRequest)


def test_stop_strings_are_capped(client):
    out = client.completions.create(model="fake", prompt="Hello", max_tokens=2,
                                    stop=["a1", "a2", "a3", "a4"])
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake", prompt="Hello", max_tokens=2,
                                  stop=[f"s{i}" for i in range(5)])
    assert e.value.body["param"] == "stop"
    assert "at most 4 stop strings" in e.value.body["message"] and "got 5" in e.value.body[
        "message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                       stop=[f"s{i}" for i in range(5)])


def test_duplicate_authorization_headers_are_refused(served):
    url, _ = served
    for second in (AUTH["Authorization"], "Bearer other"):
        r = httpx.get(f"{url}/v1/models", headers=[("Authorization", AUTH["Authorization"]),
                                                   ("Authorization", second)])
        assert r.status_code == 400 and "2 Authorization headers" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200


def test_docs_are_open_by_default_and_off_by_flag(served, smollm2_tokenizer):
    url, _ = served
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}").status_code == 200  # no key needed, as vLLM
    assert httpx.get(f"{url}/metrics").status_code == 200
    llm = AsyncLLM(CountingEngine(smollm2_tokenizer), log_interval=0)
    try:
        with running_server(build_app(llm, ["fake"], api_key=API_KEY,
                                      disable_docs=True)) as (_, off):
            for path in ("/docs", "/redoc", "/openapi.json"):
                r = httpx.get(f"{off}{path}", headers=AUTH)
                assert r.status_code == 404 and r.json()["error"]["code"] == 404
            assert httpx.get(f"{off}/metrics").status_code == 200
    finally:
        llm.shutdown()
    args = build_parser().parse_args(["serve", "--disable-fastapi-docs"])
    assert args.disable_fastapi_docs


@pytest.mark.parametrize("flag, value, least", [
    ("--max-tokenize-tokens", "0", 1), ("--max-stop-strings", "0", 1),
    ("--heavy-request-bytes", "0", 1), ("--heavy-prepare-workers", "0", 1),
    ("--heavy-prepare-queue", "-1", 0), ("--heavy-prepare-share", "0", None),
    ("--heavy-prepare-share", "1.5", None)])
def test_serve_flags_are_checked_before_loading(flag, value, least):
    args = build_parser().parse_args(["serve", flag, value])
    expected = f"^{flag} must be at least {least}, got {value}$" if least is not None \
        else rf"^{flag} must be in \(0, 1\], got {float(value)}$"
    with pytest.raises(ValueError, match=expected):
        serve_run(args)


def test_heavy_calls_leave_the_rest_of_the_time_to_other_work():
    async def scenario():
        lanes = PrepareLanes(PrepareLimits(heavy_share=0.25))
        marks = []

        def work():
            marks.append(time.monotonic())
            time.sleep(0.1)
            marks.append(time.monotonic())

        await asyncio.gather(lanes.run(True, work), lanes.run(True, work))
        lanes.shutdown()
        return marks

    start1, end1, start2, _ = asyncio.run(scenario())
    busy = end1 - start1
    assert start2 - end1 >= 3 * busy * 0.99  # a share of 1/4: three times the call's time

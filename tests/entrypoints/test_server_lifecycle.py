"""Server life cycle: listening at once with `/health` reporting start-up progress (issue 19
item 4), and the SIGTERM drain (issue 12 item 10): 503s while draining, in-flight work
finishes, the rest ends with an error event and `[DONE]`."""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app, start_in_background
from jaxserve.entrypoints.openai.serving_base import ServingLimits
from tests.entrypoints.conftest import LIMITS, MODEL_NAME, ServerThread, running_server, sse_events
from tests.entrypoints.fake_engine import FakeEngine


def test_health_reports_start_up_progress_then_ready():
    app = build_app(None, ["fake"], limits=ServingLimits(max_chars_per_token=0))
    release, errors = threading.Event(), []

    def build(startup):
        startup.engine = SimpleNamespace(warmup_progress=(1, 3))
        startup.phase = "warm-up"
        assert release.wait(30)
        return AsyncLLM(FakeEngine(), log_interval=0)

    with running_server(app) as (_, url):
        start_in_background(app, build, on_error=errors.append)
        deadline = time.time() + 10
        while True:
            r = httpx.get(f"{url}/health")
            if r.json().get("status") == "starting" and "warmup" in r.json():
                break
            assert time.time() < deadline, r.text
            time.sleep(0.02)
        assert r.status_code == 503 and r.json()["warmup"] == "1/3 buckets"
        v1 = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert v1.status_code == 503 and v1.json()["error"]["code"] == 503
        assert "warm-up 1/3 buckets" in v1.json()["error"]["message"]
        release.set()
        deadline = time.time() + 10
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.02)
        assert not errors
        release.set()


def test_failed_start_up_is_reported():
    app = build_app(None, ["fake"])
    failures = []

    def build(startup):
        raise ValueError("no such model file")

    with running_server(app) as (_, url):
        start_in_background(app, build, on_error=failures.append).join(10)
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "no such model file" in r.json()["detail"] and len(failures) == 1


@pytest.fixture(scope="module")
def draining_server(smollm2, smollm2_tokenizer):
    srv = ServerThread(smollm2, smollm2_tokenizer, shutdown_timeout=3.0, num_kv_blocks=64,
                       **LIMITS)
    yield srv
    srv.stop()


def test_sigterm_drains_then_ends_what_is_left_with_an_error_event(draining_server):
    srv = draining_server
    events = {"long": [], "short": []}
    # Both requests must reach the server before SIGTERM: one that arrives after it gets the
    # drain's plain 503, not a stream. The short one (16 tokens, ~0.3 s) then usually
    # finishes during the drain; the long one (250) outlasts the drain's 3 s.
    started = {"long": threading.Event(), "short": threading.Event()}

    def stream(name, max_tokens):
        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                started[name].set()
                events[name].append(line)

    workers = [threading.Thread(target=stream, args=("long", 250)),
               threading.Thread(target=stream, args=("short", 16))]
    for w in workers:
        w.start()
    assert all(e.wait(60) for e in started.values())
    t0 = time.monotonic()
    srv.server.handle_exit(signal.SIGTERM, None)
    time.sleep(0.2)
    # Draining: the listener is still open and answers new work with a JSON 503.
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/health").json() == {"status": "draining"}
    for w in workers:
        w.join(60)
    srv.thread.join(60)
    assert not srv.thread.is_alive() and time.monotonic() - t0 < 30

    short = sse_events(httpx.Response(200, text="\n".join(events["short"])))
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    long = sse_events(httpx.Response(200, text="\n".join(events["long"])))
    assert long[-1] == "[DONE]" and long[-2]["error"]["code"] == 503
    assert any(e["choices"][0]["text"] for e in long[:-2])  # it had streamed tokens before


def test_clients_leaving_while_their_requests_wait_abort_them_at_once():
    """Requests that never got a token (waiting for a slot) are aborted as soon as their
    clients leave, not when they are finally scheduled (issue 13 item 7)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.entrypoints.conftest import fake_server

    engine = FakeEngine(step_seconds=0.01, stall_on=[7, 7, 7])

    def impatient(url):
        # NOTE: 2 s for the server to take all ten in, even on a loaded machine: a request
        # that never reached the engine would never show up as aborted.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", timeout=2.0,
                       json={"model": "fake", "prompt": [7, 7, 7], "max_tokens": 5})

    with fake_server(engine=engine) as url:
        with ThreadPoolExecutor(10) as pool:
            list(pool.map(impatient, [url] * 10))
        left = time.time()
        while (engine.running or len(engine.aborted) < 10) and time.time() < left + 5:
            time.sleep(0.02)
        assert len(engine.aborted) == 10 and not engine.running
        assert time.time() - left < 3  # a poll interval or so, not "when scheduled" (never)
        r = httpx.post(f"{url}/v1/completions", timeout=10,
                       json={"model": "fake", "prompt": [8, 9], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t0 t1 t2 "

"""Serving tests' shared pieces: an in-process server on a free loopback port (one per test
process, `--api-key` set), the `openai` client for it, `/metrics` and SSE readers."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import ServingLimits, build_app, make_server
from jaxserve.metrics import ServerMetrics

MODEL_NAME = "SmolLM2-135M-Instruct"
API_KEY = "sk-jaxserve-test"
# Small limits keep warm-up and steps cheap on a loaded 2-core machine.
LIMITS = dict(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)


def wait_for(condition, timeout=5.0) -> bool:
    """Polls `condition()` every 10 ms until it holds or `timeout` seconds pass; returns its
    last value (for an `assert`)."""
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    return condition()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app, shutdown_timeout: float = 5.0):
    """`app` served by uvicorn in a thread on a free loopback port: yields (server, url);
    drains and joins it on exit."""
    port = free_port()
    server = make_server(app, "127.0.0.1", port, shutdown_timeout, "warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.handle_exit(15, None)
        thread.join(30)


@contextlib.contextmanager
def fake_server(step_seconds: float = 0.005, engine=None):
    """An OpenAI server over a `FakeEngine` (no model; `engine` or a new one): yields its
    URL."""
    from tests.entrypoints.fake_engine import FakeEngine

    engine = engine or FakeEngine(step_seconds=step_seconds)
    llm = AsyncLLM(engine, ServerMetrics("fake"), log_interval=0)
    try:
        with running_server(build_app(llm, ["fake"])) as (_, url):
            yield url
    finally:
        llm.shutdown()


class ServerThread:
    """An `AsyncLLM` over the shared model, served by uvicorn in a thread on 127.0.0.1.

    Args:
        model: Loaded `models.model.Model`.
        tokenizer: Its tokenizer.
        api_key: Require this Bearer key on `/v1/*`.
        shutdown_timeout: Graceful-shutdown limit of the server.
        limits: The server's `ServingLimits` (None: the defaults).
        **engine_args: Engine arguments (small limits for tests).
    """

    def __init__(self, model, tokenizer, api_key=None, shutdown_timeout=30.0, limits=None,
                 **engine_args):
        metrics = ServerMetrics(MODEL_NAME)
        self.llm = AsyncLLM.from_engine_args(model, tokenizer=tokenizer, metrics=metrics,
                                             log_interval=0, **engine_args)
        self.app = build_app(self.llm, [MODEL_NAME], api_key=api_key, limits=limits)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, "127.0.0.1", self.port, shutdown_timeout,
                                  "warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful stop, as on SIGTERM (in-flight requests finish, then the engine stops)."""
        self.server.handle_exit(15, None)
        self.thread.join(timeout)
        self.llm.shutdown()

    def metrics(self) -> dict[str, float]:
        """`/metrics` parsed: `{sample name{labels}: value}` plus plain names."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
                                + "}" if extra else "")
                values[key] = s.value
        return values

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Polls `/metrics` until nothing runs or waits and the KV cache is empty."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            idle = (m["jaxserve:num_requests_running"] == 0
                    and m["jaxserve:num_requests_waiting"] == 0
                    and m["jaxserve:kv_cache_usage_perc"] == 0)
            if idle or time.time() > deadline:
                return m
            time.sleep(0.2)


def sse_events(response: httpx.Response) -> list:
    """Decoded `data:` events of a streamed response (`"[DONE]"` kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# NOTE: session scope, not package: the heaviest-first file order (tests/conftest.py) runs
# other packages' files between this package's, and a package fixture is torn down each time
# the run leaves the package, so every serving file warmed up a SmolLM2 server again.
@pytest.fixture(scope="session")
def server(smollm2, smollm2_tokenizer):
    """The default SmolLM2 engine behind uvicorn on 127.0.0.1, `--api-key` and
    `--enable-prompt-tokens-details` set (one per test process: the serving files share it,
    and stopped at the end of the session)."""
    srv = ServerThread(smollm2, smollm2_tokenizer, api_key=API_KEY, num_kv_blocks=64,
                       limits=ServingLimits(enable_prompt_tokens_details=True), **LIMITS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    """The official `openai` client pointed at `server`."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)

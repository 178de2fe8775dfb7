"""vLLM's development endpoints over a real tiny engine: `/sleep` frees the KV cache and
completions are refused while it sleeps, `/wake_up` (whole, or by memory tag) serves the
same tokens again, `/is_sleeping`, `/reset_prefix_cache`; none of them exists without
development mode."""

from __future__ import annotations

import httpx
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.dev_routes import dev_mode_from_env
from jaxserve.metrics import ServerMetrics
from tests.conftest import TINY_ENGINE
from tests.entrypoints.conftest import running_server
from tests.entrypoints.fake_engine import FakeEngine

NAME = "tiny"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from jaxserve.engine.llm import LLM

    engine = LLM(tiny_model_dir, warmup=False, **TINY_ENGINE).engine
    llm = AsyncLLM(engine, ServerMetrics(NAME), log_interval=0)
    with running_server(build_app(llm, [NAME], server_dev_mode=True)) as (_, url):
        yield url, engine


def complete(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=NAME, prompt="The capital of France is",
                                     max_tokens=6, temperature=0).choices[0].text


def test_sleep_refuses_completions_and_wake_up_serves_the_same(served):
    url, engine = served
    before = complete(url)
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.post(f"{url}/sleep", params={"level": 1}).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert engine.runner.kv_pages is None
    with pytest.raises(openai.BadRequestError, match="sleeping"):
        complete(url)
    assert httpx.post(f"{url}/wake_up").status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert complete(url) == before


def test_partial_wake_up_by_tags(served):
    """vLLM's `POST /wake_up?tags=...`: the weights alone leave the engine sleeping (the pool
    unallocated, completions refused), the KV cache then ends the sleep; an unknown tag is
    a 400 that wakes nothing; repeated `tags` wake several."""
    url, engine = served
    before = complete(url)
    assert httpx.post(f"{url}/sleep", params={"level": 1}).status_code == 200
    assert httpx.post(f"{url}/wake_up", params={"tags": "weights"}).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert engine.runner.kv_pages is None
    with pytest.raises(openai.BadRequestError, match="still asleep: kv_cache"):
        complete(url)
    bad = httpx.post(f"{url}/wake_up", params={"tags": "kv"})
    assert bad.status_code == 400 and "unknown memory tag" in bad.json()["error"]["message"]
    assert engine.runner.kv_pages is None
    assert httpx.post(f"{url}/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert complete(url) == before
    httpx.post(f"{url}/sleep", params={"level": 2})
    both = httpx.post(f"{url}/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")])
    assert both.status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert complete(url) == before


def test_bad_levels_and_cache_reset(served):
    url, _ = served
    bad = httpx.post(f"{url}/sleep", params={"level": 3})
    assert bad.status_code == 400 and "level must be 1 or 2" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200


def test_no_dev_endpoints_without_dev_mode(monkeypatch):
    app = build_app(AsyncLLM(FakeEngine(), log_interval=0), [NAME])
    with running_server(app) as (_, url):
        for method, path in (("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"),
                             ("post", "/reset_prefix_cache")):
            assert getattr(httpx, method)(f"{url}{path}").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert dev_mode_from_env()
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    assert not dev_mode_from_env()

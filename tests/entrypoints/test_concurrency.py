"""64 concurrent streaming clients on a page budget that forces preemption, then a graceful stop.

The server runs the tiny random model of `tests/conftest.py` (SmolLM2's tokenizer): what is
checked is scheduling, streaming and the stop, not the weights (the full model spent ~30 s in
the 64 clients' steps alone)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, LIMITS, MODEL_NAME, ServerThread, wait_for

PROMPTS = [f"Fact number {i}: the" for i in range(8)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def small_server(tiny_model_dir):
    """9 usable pages of 8 tokens: 8 running requests of 16+ tokens cannot all fit."""
    from models.loaders import load_model, load_tokenizer

    srv = ServerThread(load_model(tiny_model_dir, "float32"), load_tokenizer(tiny_model_dir),
                       api_key=API_KEY, block_size=8, num_kv_blocks=10, warmup=False, **LIMITS)
    yield srv
    srv.stop()


async def _greedy(base_url: str, prompts: list[str]) -> list[str]:
    aclient = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                 timeout=300)
    outs = await asyncio.gather(*(aclient.completions.create(
        model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True}) for p in prompts))
    return [o.choices[0].text for o in outs]


def test_64_streaming_clients_finish_under_preemption(small_server):
    # References one request at a time, which fits the pool (3 of its 9 pages): nothing is
    # preempted.
    reference = {p: asyncio.run(_greedy(f"{small_server.url}/v1", [p]))[0] for p in PROMPTS}
    before = small_server.wait_idle()
    assert before["jaxserve:num_preemptions_total"] == 0

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return prompt, text, finish, usage

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{small_server.url}/v1", api_key=API_KEY,
                                     max_retries=0, timeout=300)
        return await asyncio.gather(*(one(aclient, PROMPTS[i % 8]) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, text, finish, usage in results:
        assert finish == "length" and usage.completion_tokens == MAX_TOKENS
        assert text == reference[prompt], prompt
    after = small_server.wait_idle()
    assert after["jaxserve:num_preemptions_total"] > before["jaxserve:num_preemptions_total"]
    assert after["jaxserve:kv_cache_usage_perc"] == 0
    assert after["jaxserve:num_requests_running"] == after["jaxserve:num_requests_waiting"] == 0
    grew = after["jaxserve:request_success_total{finished_reason=length}"] - before.get(
        "jaxserve:request_success_total{finished_reason=length}", 0)
    assert grew == 64


def test_graceful_stop_finishes_in_flight_requests(small_server):
    # 48 tokens (7 of the 9 pages): still streaming when the stop begins.
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", f"{small_server.url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as r:
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: "):
                    events.append(line)

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(60)
    stopper = threading.Thread(target=small_server.stop)
    stopper.start()  # what SIGTERM does
    assert wait_for(lambda: small_server.app.state.draining, 30)  # NOTE: no fixed sleep
    try:
        late = httpx.post(f"{small_server.url}/v1/completions", json=body, timeout=10)
        assert late.status_code == 503  # admitted by the socket, refused by the app
    except httpx.TransportError:
        pass  # the listening socket is already closed
    worker.join(120)
    stopper.join(120)
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in events[-2]
    assert not small_server.llm.is_running

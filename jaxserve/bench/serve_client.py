"""Online benchmark client: Poisson arrivals against a running OpenAI-compatible server.

Each request of a trace is sent at its arrival time (or all at once) to
`/v1/completions` with its prompt as token ids, `max_tokens` = its output length,
`ignore_eos` and `stream: true`. Every streamed chunk's arrival is stamped (TTFT is the
first chunk, ITL the gaps between chunks, as `vllm bench serve` does), and the final
usage chunk gives the exact token count. Results use `vllm bench serve`'s field names.
"""

from __future__ import annotations

import asyncio
import json
import time

from jaxserve.bench.stats import RequestTiming, summarize
from jaxserve.bench.workloads import TraceRequest


def parse_goodput(spec: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50", "e2el:2000"]` (ms) -> `{"slo_ttft_ms": 500, ...}`.

    Raises:
        ValueError: An unknown metric or a value that is not a positive number.
    """
    out = {}
    for item in spec or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput metric must be ttft, tpot or e2el, got {name!r}")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if ms <= 0:
            raise ValueError(f"goodput bound for {name} must be a positive number of ms, "
                             f"got {value!r}")
        out[f"slo_{name}_ms"] = ms
    return out


async def _one(client, url: str, body: dict, timing: RequestTiming, start: float,
               errors: list[str]) -> None:
    t_send = time.perf_counter()
    timing.arrival = t_send - start
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter() - start
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    timing.token_times.append(now)
                if chunk.get("usage"):
                    timing.num_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # every failure is reported; none stops the run
        errors.append(f"{type(e).__name__}: {e}")
        timing.token_times.clear()


async def run_serve_benchmark(base_url: str, trace: list[TraceRequest],
                              token_ids: list[list[int]], *, model: str | None = None,
                              max_concurrency: int | None = None, api_key: str | None = None,
                              goodput: dict[str, float] | None = None,
                              timeout_s: float = 600.0) -> dict:
    """Sends the trace (arrival times as given) and returns the summary.

    Args:
        base_url: e.g. http://127.0.0.1:8000 (loopback in this project).
        trace: Requests with arrival times (seconds from the start).
        token_ids: Prompt ids of each request.
        model: Model name (default: the server's first model).
        max_concurrency: At most this many requests in flight (None: no cap).
        goodput: SLO bounds from `parse_goodput`.

    Returns:
        The `summarize` fields, plus `failed`, `errors`, `max_concurrency` and the
        per-request `ttfts`, `itls`, `input_lens`, `output_lens` (seconds), as vllm saves.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        timings = [RequestTiming(0.0, r.prompt_len) for r in trace]
        errors: list[str] = []
        start = time.perf_counter()

        async def send(i: int) -> None:
            delay = trace[i].arrival_time - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": model, "prompt": token_ids[i], "max_tokens": trace[i].output_len,
                    "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            if sem is None:
                await _one(client, "/v1/completions", body, timings[i], start, errors)
            else:
                async with sem:
                    await _one(client, "/v1/completions", body, timings[i], start, errors)

        await asyncio.gather(*(send(i) for i in range(len(trace))))
        duration = time.perf_counter() - start
    res = summarize(timings, duration, **(goodput or {}))
    done = [t for t in timings if t.token_times]
    res.update({
        "model_id": model, "num_prompts": len(trace), "failed": len(trace) - len(done),
        "errors": errors[:20], "max_concurrency": max_concurrency,
        "input_lens": [t.prompt_len for t in done], "output_lens": [t.output_len for t in done],
        "ttfts": [t.ttft for t in done], "itls": [t.itls for t in done],
    })
    return res

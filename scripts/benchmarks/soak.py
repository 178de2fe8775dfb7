"""A soak of the OpenAI server (issue 50 item 5): a real `jaxserve serve` (ngram speculative
decoding on) under a mixed random load for a set time, then the checks that prove it held.

The load: completions and chats, streamed and not, n > 1, logprobs, structured outputs (a
JSON schema, a choice), bad requests (400/404 expected), clients that leave mid-stream and
requests aborted by a client timeout, small /tokenize calls. The checks: every good request
answered in full, a fixed probe set's greedy outputs unchanged from before the load, KV usage
back to 0, no request left in the scheduler, resident memory within `--rss-bound-mb` of its
level after warm-up (the engine's, then a first stretch of the same load, `--settle-minutes`,
which meets every path once: grammars, logprobs, n > 1), no compilation after the engine's
warm-up, no internal error in the server's log. Prints a report (and `--json` writes it);
exits 1 when a check fails.

    python -m scripts.benchmarks.soak                          # 30 minutes, the default model
    python -m scripts.benchmarks.soak --minutes 2 --model DIR  # the slow-tier test's run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter

import httpx

from scripts.benchmarks.server_process import ServerProcess

PROBES = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
          "1, 2, 3, 4,", "The quick brown fox"]
WORDS = "the a of river stone light north quiet seven market song garden over".split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
BAD = [  # (path, body, expected status)
    ("/v1/completions", {"prompt": "x", "top_k": 2**40, "temperature": 1.0}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
    ("/v1/completions", "{not json", 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(100)]}, 400),
    ("/tokenize", {"prompt": 5}, 400),
]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


def _sampling(rng: random.Random) -> dict:
    body = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randint(0, 1000)}
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    return body


def _good_request(rng: random.Random) -> tuple[str, str, dict]:
    """(kind, path, body) of a request that must be answered in full."""
    kind = rng.choice(["completion", "completion", "chat", "chat", "structured", "choice",
                       "tokenize"])
    stream = rng.random() < 0.5
    if kind == "completion":
        body = {"prompt": _prompt(rng), **_sampling(rng), "stream": stream}
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
        return kind, "/v1/completions", body
    if kind == "tokenize":
        return kind, "/tokenize", {"prompt": _prompt(rng)}
    body = {"messages": [{"role": "user", "content": _prompt(rng)}], **_sampling(rng),
            "stream": stream}
    if kind == "chat" and rng.random() < 0.3:
        body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
    if kind == "structured":
        body.update(max_tokens=48, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    if kind == "choice":
        body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]}
    return kind, "/v1/chat/completions", body


def _check_answer(body: dict, data) -> str | None:
    """None when a whole answer is well formed, else what is wrong."""
    if not isinstance(data, dict) or "choices" not in data:
        return f"no choices: {str(data)[:200]}"
    n = body.get("n", 1)
    if len(data["choices"]) != n:
        return f"{len(data['choices'])} choices, asked {n}"
    for c in data["choices"]:
        if c.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {c.get('finish_reason')!r}"
    return None


class Soak:
    """The load's bookkeeping: what was sent, answered, refused and failed."""

    def __init__(self, url: str, seed: int):
        self.url, self.rng = url, random.Random(seed)
        self.sent, self.answered, self.failures = Counter(), Counter(), []

    async def one(self, client: httpx.AsyncClient) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.08:
            path, body, status = rng.choice(BAD)
            content = body if isinstance(body, str) else json.dumps(body)
            r = await client.post(path, content=content,
                                  headers={"Content-Type": "application/json"})
            self._count("bad", r.status_code == status and "error" in r.json(),
                        f"{path} {str(body)[:60]}: {r.status_code}")
            return
        if roll < 0.14:  # a client that leaves after the first event of a stream
            body = {"prompt": _prompt(rng), "max_tokens": 64, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break
            self._count("left", True, "")
            return
        if roll < 0.20:  # aborted: the client gives up before the answer
            body = {"prompt": _prompt(rng), "max_tokens": 200, "ignore_eos": True}
            try:
                await client.post("/v1/completions", json=body,
                                  timeout=rng.uniform(0.05, 0.5))
            except httpx.TimeoutException:
                pass
            self._count("aborted", True, "")
            return
        kind, path, body = _good_request(rng)
        if body.get("stream"):
            error = await self._stream(client, path, body)
        else:
            r = await client.post(path, json=body)
            error = f"status {r.status_code}: {r.text[:200]}" if r.status_code != 200 \
                else None if kind == "tokenize" else _check_answer(body, r.json())
        self._count(kind + (" stream" if body.get("stream") else ""), error is None,
                    f"{path}: {error}")

    async def _stream(self, client: httpx.AsyncClient, path: str, body: dict) -> str | None:
        finished, done = set(), False
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}: {(await r.aread())[:300]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    return f"error event {event['error']}"
                for c in event.get("choices", []):
                    if c.get("finish_reason"):
                        finished.add(c["index"])
        if not done or len(finished) != body.get("n", 1):
            return f"stream ended early: [DONE] {done}, {len(finished)} choices finished"
        return None

    def _count(self, kind: str, ok: bool, what: str) -> None:
        self.sent[kind] += 1
        if ok:
            self.answered[kind] += 1
        else:
            self.failures.append(f"{kind}: {what}")

    async def run(self, seconds: float, concurrency: int, sample=None,
                  every: float = 10.0) -> None:
        """The load for `seconds`, calling `sample()` every `every` seconds meanwhile."""
        end = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as client:
            async def worker():
                while time.monotonic() < end:
                    try:
                        await self.one(client)
                    except Exception as e:  # noqa: BLE001 - every failure is reported
                        self.failures.append(f"exception: {type(e).__name__}: {e}")
            async def sampler():
                while sample is not None and time.monotonic() < end:
                    await asyncio.sleep(min(every, max(0.0, end - time.monotonic())))
                    sample()
            await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))


def probe_outputs(url: str) -> list[str]:
    """Greedy outputs of the fixed probe set, one request at a time."""
    with httpx.Client(base_url=url, timeout=300) as c:
        return [c.post("/v1/completions", json={"prompt": p, "max_tokens": 16,
                                                "temperature": 0}).json()["choices"][0]["text"]
                for p in PROBES]


def _metric(m: dict, name: str) -> float:
    found = [v for k, v in m.items() if k.split("{")[0] in (name, name + "_total")]
    return sum(found)


def wait_idle(server: ServerProcess, timeout: float = 120.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        busy = sum(_metric(m, f"jaxserve:num_requests_{s}")
                   for s in ("running", "waiting", "swapped"))
        if (busy == 0 and _metric(m, "jaxserve:kv_cache_usage_perc") == 0) \
                or time.time() > deadline:
            return m
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="load time (default 30)")
    p.add_argument("--model", default=None, help="the model (default: the embedded one)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")
    p.add_argument("--rss-bound-mb", type=float, default=200.0,
                   help="how far resident memory may end above its level after warm-up "
                        "(default 200)")
    p.add_argument("--settle-minutes", type=float, default=None,
                   help="first stretch of the load that completes the warm-up before the "
                        "memory baseline (default: a fifth of --minutes, at most 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--server-args", default="", help="more `serve` flags")
    args = p.parse_args(argv)
    flags = ["--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens",
             "64", "--num-kv-blocks", "2048", "--log-interval", "0", "--speculative-config",
             '{"method": "ngram", "num_speculative_tokens": 2}', *args.server_args.split()]
    if args.model:
        flags = [args.model, *flags]
    log = os.path.join(tempfile.gettempdir(), f"soak_server_{os.getpid()}.log")
    started = time.time()
    server = ServerProcess(flags, log)
    try:
        before = probe_outputs(server.url)
        base = wait_idle(server)
        rss_engine = server.rss_mb()
        compiles_warm = _metric(base, "jaxserve:num_compilations")
        soak = Soak(server.url, args.seed)
        settle = min(3.0, args.minutes / 5) if args.settle_minutes is None \
            else args.settle_minutes
        samples = []  # (seconds into the load, RSS MB)
        t0 = time.monotonic()

        def sample():
            samples.append((round(time.monotonic() - t0), round(server.rss_mb(), 1)))

        asyncio.run(soak.run(settle * 60, args.concurrency, sample))
        rss_warm = server.rss_mb()
        asyncio.run(soak.run((args.minutes - settle) * 60, args.concurrency, sample))
        end = wait_idle(server)
        after = probe_outputs(server.url)
        end = wait_idle(server)
        rss_end = server.rss_mb()
    finally:
        status = server.stop()
    checks = {
        "every good request answered": not soak.failures,
        "probe outputs unchanged": before == after,
        "KV usage back to 0": _metric(end, "jaxserve:kv_cache_usage_perc") == 0,
        "no request left in the scheduler": sum(
            _metric(end, f"jaxserve:num_requests_{s}") for s in ("running", "waiting",
                                                                 "swapped")) == 0,
        f"RSS within {args.rss_bound_mb:.0f} MB of warm-up": rss_end - rss_warm
        <= args.rss_bound_mb,
        "no compilation after warm-up": _metric(end, "jaxserve:num_compilations")
        == compiles_warm,
        "server exited cleanly": status == 0,
        "no internal error in the server log": "Traceback" not in open(log).read(),
    }
    report = {
        "minutes": args.minutes, "concurrency": args.concurrency, "seed": args.seed,
        "wall_s": round(time.time() - started, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "sent": dict(soak.sent), "answered": dict(soak.answered),
        "failures": soak.failures[:20], "num_failures": len(soak.failures),
        "settle_minutes": settle, "rss_after_engine_warmup_mb": round(rss_engine, 1),
        "rss_after_warmup_mb": round(rss_warm, 1), "rss_end_mb": round(rss_end, 1),
        "rss_samples": samples,
        "compilations_after_warmup": _metric(end, "jaxserve:num_compilations") - compiles_warm,
        "generation_tokens": _metric(end, "jaxserve:generation_tokens"),
        "preemptions": _metric(end, "jaxserve:num_preemptions"),
        "probe_outputs": after, "checks": checks, "passed": all(checks.values()),
        "server_log": log,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

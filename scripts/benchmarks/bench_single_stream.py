"""Benchmark: one user's decode speed, `jaxserve serve` against llama.cpp's `llama-server`
on the same GGUF file (issue 49): one streamed completion at a time, greedy, `ignore_eos`,
the two servers interleaved (A, B, B, A, ...; the one not measured sits idle).

Each request's decode rate is (tokens - 1) / (last token - first token), so the prompt's
step and the HTTP set-up are left out; time to first token is printed beside it. Both
servers get the same prompt and token count (checked: `usage.completion_tokens`).

    python -m scripts.benchmarks.bench_single_stream --llama-server /path/to/llama-server --rounds 4

`--jaxserve-url` / `--peer-url` use servers already running instead of starting them;
`--jaxserve-args` passes flags to the `jaxserve serve` this script starts (default: none,
the defaults a user gets). llama.cpp is never a dependency of jaxserve: build it from source
(BENCHMARKS.md says how) to run this.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tempfile
import time

import httpx

from scripts.benchmarks.server_process import LlamaServer, ServerProcess

PROMPT = "Write a long story about a cat who learns to sail."


def stream_once(url: str, model: str, max_tokens: int) -> dict:
    """One streamed completion: {"ttft_s", "decode_tok_s", "tokens"}."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
    if tokens is None or first is None:
        raise RuntimeError(f"{url}: the stream carried no tokens or no usage")
    return {"ttft_s": first - start, "tokens": tokens,
            "decode_tok_s": (tokens - 1) / max(last - first, 1e-9)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", help="llama-server binary to start on the same file")
    p.add_argument("--peer-url", help="a running llama-server instead")
    p.add_argument("--jaxserve-url", help="a running jaxserve server instead")
    p.add_argument("--jaxserve-args", default="", help="flags for the started jaxserve serve")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ctx", type=int, default=4096, help="llama-server's context (-c)")
    args = p.parse_args()
    if not (args.llama_server or args.peer_url):
        p.error("give --llama-server or --peer-url")
    from models.default_model import default_model_path

    gguf = default_model_path()
    logs = tempfile.mkdtemp(prefix="single_stream_")
    ours = None if args.jaxserve_url else ServerProcess(
        shlex.split(args.jaxserve_args), os.path.join(logs, "jaxserve.log"))
    llama = None
    try:
        jax_url = args.jaxserve_url or ours.url
        peer_url = args.peer_url
        if not peer_url:  # 2 threads like jaxserve's 2 cores, one slot: one user
            llama = LlamaServer(args.llama_server, gguf, args.ctx, os.path.join(logs, "llama.log"),
                                ("-t", "2", "-tb", "2", "-np", "1"))
            peer_url = llama.url
        served = httpx.get(f"{jax_url}/v1/models").json()["data"][0]["id"]
        servers = {"jaxserve": (jax_url, served), "llama.cpp": (peer_url, "default")}
        for url, model in servers.values():  # warm both (programs, caches)
            stream_once(url, model, 8)
        print(f"# {args.max_tokens} tokens a request, greedy, ignore_eos; logs in {logs}")
        print("| round | server | load avg | decode tok/s | TTFT ms |\n|---:|---|---:|---:|---:|")
        rates = {name: [] for name in servers}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for name in order:
                res = stream_once(*servers[name], args.max_tokens)
                if res["tokens"] != args.max_tokens:
                    raise RuntimeError(f"{name} generated {res['tokens']} tokens")
                rates[name].append(res["decode_tok_s"])
                print(f"| {r + 1} | {name} | {os.getloadavg()[0]:.2f} | "
                      f"{res['decode_tok_s']:.1f} | {1000 * res['ttft_s']:.0f} |", flush=True)
        med = {n: sorted(v)[len(v) // 2] for n, v in rates.items()}
        print(f"\nmedian decode tok/s: jaxserve {med['jaxserve']:.1f}, llama.cpp "
              f"{med['llama.cpp']:.1f}, ratio {med['jaxserve'] / med['llama.cpp']:.2f}")
    finally:
        if ours is not None:
            ours.stop()
        if llama is not None:
            llama.stop()


if __name__ == "__main__":
    main()

"""Ray batch inference against one in-process engine on the same batch file, interleaved.

Each round runs the same N-request OpenAI batch three ways: one `AsyncLLM` in this
process (`jaxserve.entrypoints.run_batch`, the baseline), and
`jaxserve.entrypoints.ray_batch` on a local Ray cluster with 1 and with 2 actors. Wall
time counts everything a user waits for (engine or cluster and actor start-up, warm-up,
the run); "actor tok/s" is tokens over the time actors spent answering batches (start-up
excluded). Ratios are to the baseline of the same round; the load average is recorded
beside each run.

    python -m scripts.benchmarks.bench_ray_batch --requests 64 --max-tokens 16 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def write_batch(path: str, n: int, max_tokens: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            body = {"model": "m", "temperature": 0, "max_tokens": max_tokens,
                    "prompt": f"Request {i}: " + "Write a short story about a lighthouse. "
                    * (1 + i % 4)}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}) + "\n")


def in_process(src: str, dst: str, engine: dict) -> dict:
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.run_batch import run_batch_file

    start = time.perf_counter()
    llm = AsyncLLM.from_engine_args(log_interval=0, **engine)
    ready = time.perf_counter()
    try:
        run_batch_file(llm, ["m"], src, dst, use_tqdm=False)
    finally:
        llm.shutdown()
    end = time.perf_counter()
    tokens = sum(json.loads(ln)["response"]["body"]["usage"]["completion_tokens"]
                 for ln in open(dst))
    return {"wall": end - start, "tokens": tokens, "actor_tps": tokens / (end - ready)}


def on_ray(src: str, dst: str, engine: dict, actors: int, batch_size: int) -> dict:
    import ray

    from jaxserve.entrypoints.ray_batch import run_batch_file

    start = time.perf_counter()
    try:
        report = run_batch_file(src, dst, engine, ["m"], address="local", num_actors=actors,
                                batch_size=batch_size, use_tqdm=False)
    finally:
        ray.shutdown()
    end = time.perf_counter()
    busy = [a for a in report["actors"].values() if a["seconds"]]
    return {"wall": end - start, "tokens": report["tokens"],
            "actor_tps": sum(a["tokens_per_second"] for a in busy)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded one)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ray-batch-size", type=int, default=32,
                   help="lines per Ray Data batch (one actor answers a batch at a time)")
    args = p.parse_args()
    engine = {"model": args.model, "max_model_len": 512, "max_num_seqs": 32,
              "max_num_batched_tokens": 256}
    tmp = tempfile.mkdtemp()
    src = os.path.join(tmp, "in.jsonl")
    write_batch(src, args.requests, args.max_tokens)
    runs = [("in-process LLM", lambda d: in_process(src, d, engine)),
            ("ray, 1 actor", lambda d: on_ray(src, d, engine, 1, args.ray_batch_size)),
            ("ray, 2 actors", lambda d: on_ray(src, d, engine, 2, args.ray_batch_size))]
    print(f"{args.requests} requests, max_tokens {args.max_tokens}, Ray batches of "
          f"{args.ray_batch_size} lines, {os.cpu_count()} CPUs")
    print("| round | run | wall s | tokens | tok/s (wall) | actor tok/s | wall vs in-process "
          "| load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        base = None
        for i, (name, fn) in enumerate(runs):
            res = fn(os.path.join(tmp, f"out{r}_{i}.jsonl"))
            base = base or res["wall"]
            print(f"| {r + 1} | {name} | {res['wall']:.1f} | {res['tokens']} | "
                  f"{res['tokens'] / res['wall']:.1f} | {res['actor_tps']:.1f} | "
                  f"{res['wall'] / base:.2f}x | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()

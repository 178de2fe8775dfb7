"""Throughput of `batch_invariant=True` against the default mode, per attention backend: the
cost of bit-for-bit batch invariance.

One loaded model (the embedded SmolLM2-135M by default, float32), one engine per (backend,
mode), prefix caching off. Each engine first runs the workload once untimed (compiling
the buckets it uses; `warmup=False`), then rounds run the engines one after another
(xla default, xla invariant, cpu default, cpu invariant, xla default, ...) on the same
prompts: `--batch` requests of `--prompt-len` random token ids, `--max-tokens` greedy
tokens each (EOS ignored). Printed per engine: the median over rounds of output tok/s
and of all tokens (prompt + output) per second, with each round's load average, and the
ratio invariant / default per backend.

Usage: python -m scripts.benchmarks.bench_batch_invariant [--backends xla,cpu] [--batch 16]
       [--prompt-len 128] [--max-tokens 32] [--rounds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from jaxserve import LLM, SamplingParams
from models.default_model import default_model_path
from models.loaders import load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="xla,cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()

    path = args.model or default_model_path()
    model, tokenizer = load_model(path, "float32"), load_tokenizer(path)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, model.cfg.vocab_size)
                                     for _ in range(args.prompt_len)]}
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sizes = dict(max_num_seqs=args.batch, max_num_batched_tokens=args.budget,
                 max_model_len=args.prompt_len + args.max_tokens + 16,
                 enable_prefix_caching=False, warmup=False)
    engines = {}
    for backend in args.backends.split(","):
        for invariant in (False, True):
            name = f"{backend} {'invariant' if invariant else 'default'}"
            llm = LLM(model, tokenizer=tokenizer, attention_backend=backend,
                      batch_invariant=invariant, **sizes)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)  # compiles the buckets it uses
            print(f"{name}: first run (with compiles) {time.perf_counter() - t0:.1f} s",
                  flush=True)
            engines[name] = llm

    out_tps = {n: [] for n in engines}
    all_tps = {n: [] for n in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            n_all = n_out + sum(len(o.prompt_token_ids) for o in outs)
            out_tps[name].append(n_out / dt)
            all_tps[name].append(n_all / dt)
            print(f"round {r} {name}: {dt:.2f} s, {n_out / dt:.1f} output tok/s, "
                  f"{n_all / dt:.1f} tok/s all, load {load:.2f}", flush=True)

    print(f"\nbatch {args.batch} x (prompt {args.prompt_len} + {args.max_tokens} greedy), "
          f"budget {args.budget}, median of {args.rounds} rounds:")
    for name in engines:
        print(f"  {name:14s} {statistics.median(out_tps[name]):8.1f} output tok/s "
              f"{statistics.median(all_tps[name]):9.1f} tok/s all")
    for backend in args.backends.split(","):
        d, i = f"{backend} default", f"{backend} invariant"
        print(f"  {backend}: invariant / default = "
              f"{statistics.median(out_tps[i]) / statistics.median(out_tps[d]):.2f}")


if __name__ == "__main__":
    main()

"""What `sleep` gives back and what `wake_up` costs, on the embedded default model.

An engine (SmolLM2-135M by default, its own default sizes unless given) generates, then
sleeps at level 1 (the KV page pool freed) and wakes up, then at level 2 (the weights
dropped too, read again from the model's file on wake-up). Printed: the bytes `sleep`
reports, the JAX live-array bytes and the process RSS before, asleep and awake, the
wake-up time, the compilations after wake-up (0 expected) and whether the greedy outputs
after each wake-up equal those before.

Usage: python -m scripts.benchmarks.bench_sleep [--model PATH] [--num-kv-blocks N]
"""

from __future__ import annotations

import argparse
import os
import time

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.bench.scale import rss_mib

PROMPTS = ["The capital of France is", "Write a haiku about the sea."]


def live_mib() -> float:
    return sum(x.nbytes for x in jax.live_arrays()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    args = ap.parse_args()
    kwargs = {} if args.num_kv_blocks is None else {"num_kv_blocks": args.num_kv_blocks}
    llm = LLM(args.model, **kwargs)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    def run():
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    want = run()
    pool = llm.engine.runner.kv_pages.nbytes / 2**20
    print(f"model {llm.engine.model.source}; KV pool {pool:.0f} MiB; load average "
          f"{os.getloadavg()[0]:.1f}")
    for level in (1, 2):
        before = (live_mib(), rss_mib())
        freed = llm.sleep(level=level) / 2**20
        asleep = (live_mib(), rss_mib())
        start = time.perf_counter()
        llm.wake_up()
        wake = time.perf_counter() - start
        same = run() == want
        awake = (live_mib(), rss_mib())
        print(f"  level {level}: sleep freed {freed:.0f} MiB; live arrays {before[0]:.0f} -> "
              f"{asleep[0]:.0f} -> {awake[0]:.0f} MiB; RSS {before[1]:.0f} -> {asleep[1]:.0f} "
              f"-> {awake[1]:.0f} MiB; wake_up {wake:.2f} s; compiles after "
              f"{llm.engine.runner.num_compilations}; same outputs: {same}")


if __name__ == "__main__":
    main()

"""Host time to build one step's sampling inputs, on a decode-heavy batch of mixed requests.

A real `LLMEngine` over a 1-layer random-weight model (`jaxserve.bench.overhead.tiny_model`,
SmolLM2's vocabulary) runs `--num-running` requests with mixed sampling settings (greedy,
top-p, top-k, penalties, seeds, min_tokens, logprobs, logit bias) to a steady decode state;
then each of `--steps` engine steps times `SamplingInputs.build` (the sampling rows and
arrays of the step) plus, where the runner builds them, the prompt-logprob targets
(`SamplingRows.prompt_targets`). It prints one JSON line: median and p90 milliseconds,
the checkout it imported, and the load average.

Compare two checkouts by running this script under each, interleaved (A, B, A, B):

    PYTHONPATH=/path/to/checkout python -m scripts.benchmarks.bench_sampling_inputs --num-running 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def mixed_params(i: int, max_tokens: int):
    """The i-th request's settings: eight kinds in turn."""
    from jaxserve.sampling_params import SamplingParams

    kinds = [dict(temperature=0.0),
             dict(temperature=0.8, top_p=0.9),
             dict(temperature=1.0, top_k=50, seed=1000 + i),
             dict(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.2),
             dict(temperature=1.0, seed=i),
             dict(temperature=0.0, min_tokens=4),
             dict(temperature=0.0, logprobs=5),
             dict(temperature=0.9, top_p=0.95, logit_bias={5: 1.0, 7: -1.0})]
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kinds[i % len(kinds)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-running", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    import jaxserve
    from jaxserve.bench.engine_run import make_llm
    from jaxserve.bench.overhead import tiny_model
    from models.default_model import default_model_path
    from models.loaders import load_tokenizer

    n, max_len = args.num_running, 512
    llm = make_llm(tiny_model(max_position_embeddings=max_len),
                   load_tokenizer(default_model_path()), max_model_len=max_len,
                   max_num_seqs=n, max_num_batched_tokens=256,
                   num_kv_blocks=n * max_len // 16 + 8, warmup=False)
    engine = llm.engine
    rng = np.random.default_rng(0)
    for i in range(n):
        engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(3, 30000,
                                                                       args.prompt_len).tolist()},
                           mixed_params(i, max_len - args.prompt_len - 1))
    sched = engine.scheduler
    while len(sched.running) < n or any(r.num_output_tokens < 2 for r in sched.running):
        engine.step()

    times: list[float] = []
    step_inputs = engine.sampling_inputs.build
    rows = getattr(engine.runner, "sampling_rows", None)

    def timed_step_inputs(out, *a, **kw):
        # NOTE: where the targets moved into the runner's input building, they are timed
        # too (the runner has the token offsets at hand: not timed)
        starts = None if rows is None else np.arange(len(out.scheduled) + 1)
        t0 = time.perf_counter()
        res = step_inputs(out, *a, **kw)
        if rows is not None:
            rows.prompt_targets(out, starts)
        times.append(time.perf_counter() - t0)
        return res

    engine.sampling_inputs.build = timed_step_inputs
    for _ in range(args.steps):
        engine.step()
    ms = 1000 * np.array(times)
    print(json.dumps({"checkout": os.path.dirname(os.path.dirname(jaxserve.__file__)),
                      "num_running": n, "steps": len(ms),
                      "median_ms": round(float(np.median(ms)), 3),
                      "p90_ms": round(float(np.percentile(ms, 90)), 3),
                      "load": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()

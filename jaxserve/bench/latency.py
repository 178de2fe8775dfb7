"""Latency of one batch (`bench latency`), like `vllm bench latency`: avg and percentiles.

One batch of `batch_size` requests, each `input_len` prompt tokens and `output_len`
outputs (EOS ignored), all submitted at once, is run `num_iters` times after
`num_iters_warmup` untimed runs. Each iteration draws fresh prompt ids, so prefix
caching never turns a later iteration into a cache hit.
"""

from __future__ import annotations

import numpy as np

from jaxserve.bench.engine_run import run_trace
from jaxserve.bench.workloads import TraceRequest, trace_token_ids

PERCENTILES = (10, 25, 50, 75, 90, 99)


def bench_latency(engine, *, batch_size: int, input_len: int, output_len: int,
                  num_iters: int = 3, num_iters_warmup: int = 1) -> dict:
    """Runs the batch repeatedly; returns latencies (s), percentiles and mean TTFT/TPOT/ITL.

    Returns:
        `latencies`, `avg_latency`, `percentiles` ({p: seconds}), and the mean over
        iterations of `mean_ttft_ms`, `mean_tpot_ms`, `p99_itl_ms` and `output_throughput`.
    """
    trace = [TraceRequest(input_len, output_len)] * batch_size
    avoid = tuple(engine.eos_token_ids) + (0, 1)
    latencies, runs = [], []
    for it in range(num_iters_warmup + num_iters):
        ids = trace_token_ids(trace, engine.model.cfg.vocab_size, seed=1000 + it, avoid=avoid)
        res = run_trace(engine, trace, ids, prefix=f"lat{it}")
        if it >= num_iters_warmup:
            latencies.append(res.summary["duration"])
            runs.append(res.summary)
    keys = ("mean_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "output_throughput")
    out = {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
           "latencies": latencies, "avg_latency": float(np.mean(latencies)),
           "percentiles": {p: float(np.percentile(latencies, p)) for p in PERCENTILES}}
    out.update({k: float(np.mean([r[k] for r in runs])) for k in keys})
    return out


def format_latency(res: dict) -> str:
    """`vllm bench latency`'s lines, then TTFT/TPOT/ITL of the batch."""
    lines = [f"Avg latency: {res['avg_latency']:.4f} seconds"]
    lines += [f"{p}% percentile latency: {v:.4f} seconds" for p, v in res["percentiles"].items()]
    lines.append(f"batch {res['batch_size']} x (in {res['input_len']}, out {res['output_len']}):"
                 f" mean TTFT {res['mean_ttft_ms']:.1f} ms, mean TPOT "
                 f"{res['mean_tpot_ms']:.1f} ms, P99 ITL {res['p99_itl_ms']:.1f} ms, "
                 f"{res['output_throughput']:.2f} output tok/s")
    return "\n".join(lines)

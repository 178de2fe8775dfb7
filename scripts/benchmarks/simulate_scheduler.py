r"""Simulates the real scheduler + KV cache manager on a trace with a step-cost model.

Compares the scheduling modes (naive, static, continuous, continuous+chunked) on one
trace in one run and prints throughput, TTFT, TPOT, ITL and E2E latency, plus the host
time the scheduler spent per step. Examples:

    python -m scripts.benchmarks.simulate_scheduler --num-requests 10000 --rate 100
    python -m scripts.benchmarks.simulate_scheduler --trace mixed --cost cpu-smollm2 \
        --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import time

from jaxserve.bench.simulator import PRESETS, simulate
from jaxserve.bench.workloads import load_trace, mixed_trace, synthetic_trace
from jaxserve.config import SCHEDULING_MODES, SchedulerConfig

COLUMNS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
           "mean_e2el_ms", "num_preemptions", "mean_batch_size", "host_ms_per_step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="synthetic",
                   help="synthetic, mixed, or a JSONL file written by save_trace")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals/s (default: all at 0)")
    p.add_argument("--prompt-mean", type=float, default=256)
    p.add_argument("--output-mean", type=float, default=128)
    p.add_argument("--cost", default="gpu-8b", choices=sorted(PRESETS))
    p.add_argument("--modes", default=",".join(SCHEDULING_MODES))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-pages", type=int, default=20000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object per mode")
    args = p.parse_args()

    if args.trace == "synthetic":
        trace = synthetic_trace(args.num_requests, prompt_mean=args.prompt_mean,
                                prompt_spread=args.prompt_mean / 2,
                                output_mean=args.output_mean,
                                output_spread=args.output_mean / 2, rate=args.rate,
                                max_model_len=args.max_model_len, seed=args.seed)
    elif args.trace == "mixed":
        trace = mixed_trace(args.num_requests, rate=args.rate, seed=args.seed)
    else:
        trace = load_trace(args.trace)
    print(f"trace {args.trace}: {len(trace)} requests; cost model {args.cost}: "
          f"{PRESETS[args.cost]}")
    if not args.json:
        print(f"{'mode':<20}" + "".join(f"{c:>18}" for c in COLUMNS) + f"{'sim wall s':>12}")
    for mode in args.modes.split(","):
        cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs, scheduling_mode=mode,
                              preemption_mode=args.preemption_mode)
        budget = args.max_num_batched_tokens if cfg.chunked else max(
            args.max_num_batched_tokens, args.max_model_len)
        start = time.perf_counter()
        res = simulate(trace, PRESETS[args.cost], cfg, num_pages=args.num_pages,
                       page_size=args.page_size, max_model_len=args.max_model_len,
                       max_num_batched_tokens=budget,
                       swap_space_pages=args.num_pages if args.preemption_mode == "swap"
                       else 0, seed=args.seed)
        wall = time.perf_counter() - start
        if args.json:
            print(json.dumps({"mode": mode, "wall_s": wall, **res.summary}))
        else:
            print(f"{mode:<20}" + "".join(f"{res.summary[c]:>18.2f}" for c in COLUMNS)
                  + f"{wall:>12.1f}")


if __name__ == "__main__":
    main()

"""The on-device sampler alone, per sampling setting and row count; with `--before`, another
checkout's sampler against this one's in one process, interleaved (A B A B).

Each case jits `jaxserve.sample.sample` on f32[rows, V] logits with every row set alike
(greedy, temperature, top-p, top-k, logprobs) and reports the best of `--iters` calls
per round, best over the rounds. The logits decide how many tokens top-p keeps, so give
real ones where the filters matter: `--logits FILE.npy` (f32[T, V], e.g. a model's
outputs over a text; rows are taken from it in turn); the default is Gaussian logits of
SmolLM2's vocabulary size, scaled by `--scale`.

    git worktree add /tmp/before HEAD~1
    python -m scripts.benchmarks.bench_sampler --before /tmp/before --rows 8,32,128
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.roofline import best_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {  # name: SamplingParams fields of every row
    "greedy": {"temperature": 0.0},
    "t0.8": {"temperature": 0.8},
    "t0.7-p0.9": {"temperature": 0.7, "top_p": 0.9},
    "t0.8-p0.95": {"temperature": 0.8, "top_p": 0.95},
    "t0.8-k50": {"temperature": 0.8, "top_k": 50},
    "greedy-logprobs5": {"temperature": 0.0, "logprobs": 5},
}


def load_tree(root: str):
    """`(jaxserve.sample, SamplingParams)` imported from the checkout at `root`.

    Only the `jaxserve` package comes from `root` (found there by `PathFinder`, without
    touching the import path); the other packages stay this process's.
    """
    for name in [m for m in sys.modules if m == "jaxserve" or m.startswith("jaxserve.")]:
        del sys.modules[name]
    spec = importlib.machinery.PathFinder.find_spec("jaxserve", [os.path.abspath(root)])
    if spec is None:
        raise SystemExit(f"no jaxserve package in {root}")
    package = importlib.util.module_from_spec(spec)
    sys.modules["jaxserve"] = package
    spec.loader.exec_module(package)
    sample = importlib.import_module("jaxserve.sample")
    params = importlib.import_module("jaxserve.sampling_params").SamplingParams
    return sample, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="another checkout to compare with")
    p.add_argument("--rows", default="8,32,128", help="comma list of row counts")
    p.add_argument("--cases", default=",".join(CASES), help="comma list of: " + ", ".join(CASES))
    p.add_argument("--logits", default=None, help="f32[T, V] .npy of real logits")
    p.add_argument("--scale", type=float, default=2.5, help="Gaussian logits' scale")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    args = p.parse_args()
    trees = {"now": load_tree(ROOT)}
    if args.before:
        trees = {"before": load_tree(args.before), **trees}
    pool = np.load(args.logits).astype(np.float32) if args.logits else None
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; choose from {list(CASES)}")
    print(f"load average {os.getloadavg()[0]:.2f}; ms per call, best of {args.iters} x "
          f"{args.rounds} rounds\n")
    names = list(trees)
    ratio = ["now / before"] if args.before else []
    print("| rows | setting | " + " | ".join(f"{n} ms" for n in names)
          + "".join(f" | {r}" for r in ratio) + " |")
    print("|---:|---|" + "---:|" * (len(names) + len(ratio)))
    for rows in (int(r) for r in args.rows.split(",")):
        if pool is not None:
            logits = jnp.asarray(np.resize(pool, (rows, pool.shape[1])))
        else:
            logits = jax.random.normal(jax.random.key(rows), (rows, args.vocab_size)) * args.scale
        vocab = logits.shape[1]
        for case in cases:
            calls = {}  # tree: (its jitted sampler, its metadata of the case)
            for n, (mod, sp) in trees.items():
                calls[n] = (jax.jit(mod.sample), mod.build_sampling_metadata(
                    [mod.RowSpec(sp(seed=i, **CASES[case])) for i in range(rows)], rows, vocab))
            res = {n: [] for n in names}
            for _ in range(args.rounds):
                for n in names:
                    fn, md = calls[n]
                    res[n].append(1000 * best_seconds(fn, logits, md, iters=args.iters))
            best = {n: min(v) for n, v in res.items()}
            cells = " | ".join(f"{best[n]:.2f}" for n in names)
            if args.before:
                cells += f" | {best['now'] / best['before']:.2f}"
            print(f"| {rows} | {case} | {cells} |", flush=True)


if __name__ == "__main__":
    main()

"""Decode step of a mixture of experts whose layers mix sparse and dense MLPs
(`models.mixed`) against the all-sparse and the all-dense model of the same shapes: a
mixed layer runs its own MLP only, so the mixed step should cost the mean of the other two
(half its layers dense here), not the sum of a sparse and a dense MLP in every layer.

Three random-weight models share every shape: "sparse" (every layer `--experts` experts of
`--expert-size`, top `--top-k`), "dense" (every layer a `GatedMLP` of `--dense-size`) and
"mixed" (the odd layers dense, `ArchConfig.dense_layers`). The dense MLP is made much wider
than the routed experts' work so the two kinds of layer cost clearly apart. The steps are
built and timed interleaved as in `scripts/benchmarks/bench_moe.py` (its `compiled`), on the `xla`
backend; the mixed program's HLO is also checked for its `conditional`.

Usage: python -m scripts.benchmarks.bench_mixed_moe [--batches 1,32] [--layers 4] [--rounds 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from models.config import ArchConfig
from models.default_model import default_model_path
from models.linear import ServingChoice
from models.loaders import load_tokenizer
from models.model import Model, random_params
from scripts.benchmarks.bench_moe import compiled, interleaved_ms


def configs(args) -> dict[str, ArchConfig]:
    """The three models' configs."""
    sparse = ArchConfig(architecture="Qwen3MoeForCausalLM", vocab_size=args.vocab,
                        hidden_size=args.hidden, intermediate_size=args.dense_size,
                        num_layers=args.layers, num_heads=args.hidden // 64,
                        num_kv_heads=max(1, args.hidden // 256), head_dim=64,
                        num_experts=args.experts, num_experts_per_tok=args.top_k,
                        moe_intermediate_size=args.expert_size, norm_topk_prob=True)
    return {"sparse": sparse,
            "mixed": dataclasses.replace(sparse,
                                         dense_layers=tuple(range(1, args.layers, 2))),
            "dense": dataclasses.replace(sparse, num_experts=0, num_experts_per_tok=0,
                                         moe_intermediate_size=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=1024)
    ap.add_argument("--dense-size", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    tok = load_tokenizer(default_model_path())
    models = {name: Model(cfg, random_params(cfg, seed=0), serving=ServingChoice("xla"))
              for name, cfg in configs(args).items()}
    names = list(models)
    for batch in (int(b) for b in args.batches.split(",")):
        steps = {n: compiled(models[n], tok, batch, args.context) for n in names}
        step, runner, pool = steps["mixed"]
        hlo = step.lower(runner.params, pool).compile().as_text()
        times = interleaved_ms(steps, names, args.rounds)
        med = {n: float(np.median(times[n])) for n in names}
        mean = (med["sparse"] + med["dense"]) / 2
        print(f"batch {batch}, context {args.context}: " + ", ".join(
            f"{n} {med[n]:.2f} ms" for n in names)
            + f"; mixed / mean(sparse, dense) {med['mixed'] / mean:.2f}x, "
            f"mixed / dense {med['mixed'] / med['dense']:.2f}x; conditionals in the mixed "
            f"step's HLO: {hlo.count(' conditional(')}; load {os.getloadavg()[0]:.2f}",
            flush=True)
        del steps


if __name__ == "__main__":
    main()

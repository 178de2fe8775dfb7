"""Decode step of an 8-expert top-2 MoE model against a dense model of the same active
parameters and against one that runs every expert densely (issue 45's speed targets).

Three random-weight models share every shape but the MLP: "moe" (`--experts` experts of
`--expert-size`, top `--top-k`, `models.moe`), "dense_active" (one `GatedMLP` of
top_k x expert-size: the MoE's active parameters) and "dense_all" (one `GatedMLP` of
experts x expert-size: every expert on every token, the compute and weight bytes of the
dense reference). Each decode step (`batch` requests, one new token each, every request a
different token id so the routing spreads) is compiled once per model and timed
interleaved (A B C, C B A, ...) in one process, so machine drift hits all alike. All run on
the `xla` backend (the `cpu` backend packs dense weights for its C++ matmul, which the
experts do not use: that would compare matmul kernels, not the layer).

`--int8 experts|all` adds a fourth model, "moe_int8": the MoE with its routed expert stacks
int8 per output channel (`models.quant.EXPERT_MODULES`), or every weight int8
(`quantization="int8"`), printed against the float MoE. `--routed` adds "moe_routed": the
MoE's step with routing capture (`enable_return_routed_experts`: the step also returns
every token's routed experts), printed against the MoE's.

Usage: python -m scripts.benchmarks.bench_moe [--batches 1,32] [--hidden 1024] [--layers 4]
       [--int8 experts|all] [--routed]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from jaxserve.bench.engine_run import make_llm
from jaxserve.bench.roofline import decode_pages
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from models.config import ArchConfig
from models.default_model import default_model_path
from models.linear import ServingChoice
from models.loaders import load_tokenizer
from models.model import Model, random_params
from models.quant import EXPERT_MODULES, QUANT_MODULES, QuantFormat, uniform_plan

NUM_PAGES = 1024


def configs(args) -> dict[str, ArchConfig]:
    """The three models' configs."""
    base = ArchConfig(architecture="Qwen3MoeForCausalLM", vocab_size=args.vocab,
                      hidden_size=args.hidden, intermediate_size=args.top_k * args.expert_size,
                      num_layers=args.layers, num_heads=args.hidden // 64,
                      num_kv_heads=max(1, args.hidden // 256), head_dim=64)
    return {"moe": dataclasses.replace(base, num_experts=args.experts,
                                       num_experts_per_tok=args.top_k,
                                       moe_intermediate_size=args.expert_size,
                                       norm_topk_prob=True),
            "dense_active": base,
            "dense_all": dataclasses.replace(
                base, intermediate_size=args.experts * args.expert_size)}


def decode_step(batch: int, context: int, page_size: int) -> SchedulerOutput:
    """`batch` decodes at `context`, each request its own token id (so its own routing)."""
    pages = decode_pages(context, page_size)
    return SchedulerOutput(scheduled=[
        ScheduledRequest(f"r{i}", [100 + 97 * i], context,
                         list(range(1 + pages * i, 1 + pages * (i + 1))), 1)
        for i in range(batch)])


def compiled(model: Model, tok, batch: int, context: int, routed: bool = False):
    """[the runner's `ModelStep` of one decode step, its runner, the pool it updates]."""
    llm = make_llm(model, tok, max_model_len=1024, max_num_seqs=32,
                   max_num_batched_tokens=256, num_kv_blocks=NUM_PAGES, warmup=False,
                   enable_return_routed_experts=routed)
    runner = llm.engine.runner
    step = runner.prepare_model_step(decode_step(batch, context, runner.page_size),
                                     decode_only=False)
    pool, logits, _ = step.run(runner.params, runner.kv_pages)
    logits.block_until_ready()
    return [step, runner, pool]


def interleaved_ms(steps: dict, names: list[str], rounds: int) -> dict[str, list[float]]:
    """Milliseconds of each named compiled step (`compiled`'s [step, runner, pool], its pool
    updated in place), `rounds` timed rounds after two untimed ones, the order
    reversed every other round (A, B, B, A, ...) so drifting load falls on both alike."""
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds + 2):
        for name in names if i % 2 == 0 else names[::-1]:
            step, runner, pool = steps[name]
            t = time.perf_counter()
            pool, logits, _ = step.run(runner.params, pool)
            logits.block_until_ready()
            steps[name][2] = pool
            if i >= 2:
                times[name].append(1e3 * (time.perf_counter() - t))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--int8", choices=("experts", "all"),
                    help="also time the MoE with int8 experts (or every weight int8)")
    ap.add_argument("--routed", action="store_true",
                    help="also time the MoE's step with routing capture")
    args = ap.parse_args()
    tok = load_tokenizer(default_model_path())
    cfgs = configs(args)
    models = {name: Model(cfg, random_params(cfg, seed=0), serving=ServingChoice("xla"))
              for name, cfg in cfgs.items()}
    if args.int8:
        plan = uniform_plan("int8", QuantFormat("q8", 0),
                            EXPERT_MODULES if args.int8 == "experts" else QUANT_MODULES)
        models["moe_int8"] = Model(cfgs["moe"], random_params(cfgs["moe"], seed=0, quant=plan),
                                   serving=ServingChoice("xla"), quant=plan)
    names = list(models) + (["moe_routed"] if args.routed else [])
    for batch in (int(b) for b in args.batches.split(",")):
        steps = {n: compiled(models.get(n, models["moe"]), tok, batch, args.context,
                             routed=n == "moe_routed") for n in names}
        times = interleaved_ms(steps, names, args.rounds)
        med = {n: float(np.median(times[n])) for n in names}
        print(f"batch {batch}, context {args.context}: " + ", ".join(
            f"{n} {med[n]:.2f} ms" for n in names)
            + f"; moe / dense_active {med['moe'] / med['dense_active']:.2f}x, "
            f"moe / dense_all {med['moe'] / med['dense_all']:.2f}x"
            + (f", moe_int8 / moe {med['moe_int8'] / med['moe']:.2f}x" if args.int8 else "")
            + (f", moe_routed / moe {med['moe_routed'] / med['moe']:.2f}x" if args.routed
               else "")
            + "; load "
            f"{os.getloadavg()[0]:.2f}", flush=True)
        del steps


if __name__ == "__main__":
    main()

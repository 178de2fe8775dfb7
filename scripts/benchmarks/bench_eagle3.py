"""Decode speed with a trained EAGLE-3 head against no speculation and n-grams (issue 66).

Three engines on one model (default: the embedded SmolLM2 as `jaxserve` serves it) differ in
their `speculative_config` alone: none, n-gram prompt lookup (k = 3, vLLM's lookup 1..3) and
the EAGLE-3 head at `--head` (k = 3; trained with `scripts/examples/train_eagle3_head.py`).
Each round runs the same greedy chat prompts (topics the head never saw in training) on each
engine in turn, the order rotating every round (A B C, B C A, ...: a shared machine's drift
falls on all alike): at batch 1 (`--batch1` prompts one after another) and at batch 8 (eight
prompts in one `generate`). A run's figure is its output tokens over its wall time (decode
dominates: short prompts, `--max-tokens` answers); each speculating run also reports its
acceptance rate (accepted / proposed tokens), the mean tokens per verifying step and the
acceptance at each draft position, from the engine's counters, and the acceptance gate's
cost ratio (a verifying step's measured cost in plain steps). The load average is printed
with every run.

Usage: python -m scripts.benchmarks.bench_eagle3 --head DIR [--rounds 3] [--max-tokens 128]
       [--batch1 4] [--model PATH] [--quantization none]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from jaxserve import LLM, SamplingParams
from models.default_model import default_model_path
from models.loaders import load_model, load_tokenizer
from scripts.examples.train_eagle3_head import TEMPLATES, chat_prompts

# Topics outside the training set (`train_eagle3_head.TOPICS`).
TOPICS = ["lighthouses", "origami", "penguins", "typewriters", "marathon running", "tea",
          "submarines", "the Great Wall of China"]
K = 3
_SPEC = "jaxserve:spec_decode_"


def configs(head: str) -> dict[str, dict | None]:
    return {"none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1},
            "eagle3": {"method": "eagle3", "model": head, "num_speculative_tokens": K}}


def counters(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.get_metrics().items() if k.startswith(_SPEC)}


def run(llm: LLM, batches: list[list[list[int]]], params: SamplingParams) -> dict:
    """Generates each batch in turn; output tok/s, acceptance figures, load average."""
    before = counters(llm)
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - start
    after = counters(llm)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    proposed = delta.get(_SPEC + "num_draft_tokens", 0.0)
    drafts = delta.get(_SPEC + "num_drafts", 0.0)
    accepted = delta.get(_SPEC + "num_accepted_tokens", 0.0)
    per_pos = [delta.get(f"{_SPEC}num_accepted_tokens_per_pos{{position={i}}}", 0.0)
               / drafts if drafts else 0.0 for i in range(K)]
    spec = llm.engine.speculator
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "cost_ratio": spec.gate.cost_ratio if spec is not None else 1.0,
            "acceptance": accepted / proposed if proposed else 0.0,
            "tokens_per_step": 1 + accepted / drafts if drafts else 1.0,
            "per_position": per_pos, "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns {(batch label, engine): [run, ...]}.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True, help="the EAGLE-3 head's directory")
    ap.add_argument("--model", default=None, help="the target (default: SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch1", type=int, default=4, help="prompts run one at a time")
    ap.add_argument("--quantization", default=None,
                    help="the target's weight format (default: the file's; none: float32)")
    args = ap.parse_args(argv)

    path = args.model or default_model_path()
    tokenizer, model = load_tokenizer(path), load_model(path, quantization=args.quantization)
    templates = TEMPLATES[::3]
    grid = chat_prompts(tokenizer, TOPICS, templates)  # topic-major, templates fastest
    # Each topic once per workload, the templates rotating (batch 1 starts one further on).
    pick = lambda shift: [grid[i * len(templates) + (i + shift) % len(templates)]  # noqa: E731
                          for i in range(len(TOPICS))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = {"batch 1": [[p] for p in pick(1)[:args.batch1]], "batch 8": [pick(0)]}
    engines = {}
    for name, spec in configs(args.head).items():
        t0 = time.perf_counter()
        engines[name] = LLM(model, tokenizer=tokenizer, max_num_seqs=8,
                            max_model_len=512, speculative_config=spec)
        print(f"[{name}] engine ready in {time.perf_counter() - t0:.1f} s")
    names = list(engines)
    results: dict = {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for label, batches in workloads.items():
            for name in order:
                res = run(engines[name], batches, params)
                results.setdefault((label, name), []).append(res)
                print(f"round {r} {label} {name:7s} {res['tok_s']:7.1f} tok/s  "
                      f"acceptance {res['acceptance']:.2f}  per position "
                      f"{' '.join(f'{a:.2f}' for a in res['per_position'])}  "
                      f"tokens/step {res['tokens_per_step']:.2f}  gate's cost ratio "
                      f"{res['cost_ratio']:.2f}  load {res['load']:.2f}")
    for label in workloads:
        base = statistics.median(x["tok_s"] for x in results[(label, "none")])
        for name in names:
            runs = results[(label, name)]
            med = statistics.median(x["tok_s"] for x in runs)
            acc = statistics.median(x["acceptance"] for x in runs)
            print(f"{label} {name:7s} median {med:7.1f} tok/s  x{med / base:.2f} of none  "
                  f"acceptance {acc:.2f}")
    return results


if __name__ == "__main__":
    main()

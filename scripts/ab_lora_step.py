"""Interleaved timing of one decode step with and without LoRA adapters (the model program
alone, no scheduler or sampler): the device cost of serving adapters per request.

Runners over one loaded model (SmolLM2-135M by default, in its serving form here): "base"
(no LoRA), "lora-none" (`enable_lora`, every token on the base model: the XLA forms skip
the adapter path by a `lax.cond`, the kernel returns at once; on the last of `--impls`),
and per `models.lora.LORA_IMPLS` the same decode step with its tokens spread over
`--adapters` random rank-`--rank` adapters on all seven projections. Each is timed on the
same step (a decode of `--batch` requests at `--context` tokens), in rounds whose order
reverses every other round (A B C, C B A, ...) so drifting load falls on all alike;
printed: median and best ms and the ratio to base.

Usage: python scripts/ab_lora_step.py [--batch 32] [--context 128] [--rounds 20]
       [--impls masked,gathered,grouped]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from jaxserve import LLM
from jaxserve.bench.lora_adapters import write_random_adapter
from jaxserve.bench.roofline import decode_output
from jaxserve.lora import LoRARequest
from models.default_model import default_model_path
from models.loaders import load_model, load_tokenizer
from models.lora import LORA_IMPLS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", default=None)
    ap.add_argument("--impls", default=",".join(LORA_IMPLS),
                    help="comma-separated LoRA forms to time (models.lora.LORA_IMPLS)")
    args = ap.parse_args()
    impls = args.impls.split(",")
    path = args.model or default_model_path()
    model, tokenizer = load_model(path, "float32"), load_tokenizer(path)
    sizes = dict(max_num_seqs=args.batch, max_num_batched_tokens=max(64, args.batch),
                 max_model_len=1024, warmup=False)
    lora = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    tmp = tempfile.mkdtemp(prefix="ab_lora_")
    runners = {"base": LLM(model, tokenizer=tokenizer, **sizes).engine.runner}
    for impl in impls:
        runner = LLM(model, tokenizer=tokenizer, lora_impl=impl, **sizes, **lora).engine.runner
        for s in range(args.adapters):
            req = LoRARequest(f"a{s}", s + 1, write_random_adapter(
                os.path.join(tmp, f"a{s}"), model.cfg, args.rank, seed=s))
            runner.lora.write(s, runner.lora.manager.add(req))
        runners[f"lora-{impl}"] = runner
    out = decode_output(args.batch, args.context, 16)
    steps = {}
    for name, runner in [("base", runners["base"]),
                         ("lora-none", runners[f"lora-{impls[-1]}"]),
                         *((f"lora-{impl}", runners[f"lora-{impl}"]) for impl in impls)]:
        slots = None
        if name not in ("base", "lora-none"):
            num_tokens = runner.step_shape(out)[0]
            slots = (np.arange(num_tokens) % args.adapters).astype(np.int32)
        step = runner.prepare_model_step(out, decode_only=False, lora_slots=slots)
        steps[name] = [step.program, runner, step.buf]
    times: dict[str, list[float]] = {n: [] for n in steps}
    names = list(steps)
    for i in range(args.rounds + 2):
        for name in names if i % 2 == 0 else names[::-1]:
            fn, runner, dbuf = steps[name]
            start = time.perf_counter()
            runner.kv_pages, logits, _ = fn(runner.params, runner.kv_pages, dbuf,
                                            runner.no_prev_ids, runner.lora_stacks)
            logits.block_until_ready()
            if i >= 2:
                times[name].append(1e3 * (time.perf_counter() - start))
    base = statistics.median(times["base"])
    print(f"decode step of {args.batch} requests at {args.context} tokens, {args.adapters} "
          f"adapters of rank {args.rank} (all 7 projections), {model.cfg.architecture}; "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    for name, ms in times.items():
        med = statistics.median(ms)
        print(f"  {name:14s} median {med:7.2f} ms  best {min(ms):7.2f} ms  "
              f"{base / med:5.2f}x of base")


if __name__ == "__main__":
    main()

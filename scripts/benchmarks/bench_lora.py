"""A batch of decoding requests spread over several LoRA adapters against the same batch
on the base model alone: the cost of serving adapters per request.

Engines over one loaded model (the embedded SmolLM2-135M by default, in its serving form
on this machine), each warmed up:
- "base": no LoRA at all (the baseline every ratio divides by);
- "lora-none": `enable_lora` (the default form: the CPU kernel on this machine) with every
  request on the base model (the adapter path runs, every token's slot -1);
- "lora-masked" / "lora-gathered" / "lora-grouped": `enable_lora`, the requests spread
  evenly over `--adapters` random rank-`--rank` adapters on all seven projections, with
  each of `models.linear.lora.LORA_IMPLS`.
Each round runs the engines one after another (A, B, C, D, A, B, ...) on the same prompts
(prefix caching off) and times `generate` of `--max-tokens` greedy tokens per request; the
figures are the median over rounds, with the load average beside them. Adapter load time
(reading a PEFT directory) and slot write time, and the device bytes of one slot, are
measured on the engine of the last of `--impls`.

Usage: python -m scripts.benchmarks.bench_lora [--batch 32] [--adapters 4] [--rank 16]
       [--max-tokens 64] [--rounds 3] [--model PATH] [--impls masked,gathered,grouped]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.bench.lora_adapters import write_random_adapter
from jaxserve.lora import LoRARequest
from models.default_model import default_model_path
from models.linear.lora import LORA_IMPLS
from models.loaders import load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--impls", default=",".join(LORA_IMPLS),
                    help="comma-separated LoRA forms to time (models.linear.lora.LORA_IMPLS)")
    args = ap.parse_args()

    path = args.model or default_model_path()
    model, tokenizer = load_model(path, "float32"), load_tokenizer(path)
    tmp = tempfile.mkdtemp(prefix="bench_lora_")
    loras = [LoRARequest(f"a{i}", i + 1, write_random_adapter(
        os.path.join(tmp, f"a{i}"), model.cfg, args.rank, seed=i)) for i in range(args.adapters)]
    sizes = dict(max_num_seqs=args.batch, max_num_batched_tokens=256, max_model_len=512,
                 enable_prefix_caching=False)
    lora_args = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    engines = {"base": (LLM(model, tokenizer=tokenizer, **sizes), None)}
    engines["lora-none"] = (LLM(model, tokenizer=tokenizer, **sizes, **lora_args), None)
    for impl in args.impls.split(","):
        engines[f"lora-{impl}"] = (LLM(model, tokenizer=tokenizer, lora_impl=impl, **sizes,
                                       **lora_args), loras)
    prompts = [f"Request {i}: write a short story about the number {i * 7 + 3}."
               for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    loads: list[float] = []
    for _ in range(args.rounds + 1):  # the first round loads the adapters: not counted
        for name, (llm, adapters) in engines.items():
            per_prompt = None if adapters is None else [
                adapters[i % len(adapters)] for i in range(args.batch)]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
            seconds[name].append(time.perf_counter() - start)
        loads.append(os.getloadavg()[0])
    tokens = args.batch * args.max_tokens
    base = statistics.median(seconds["base"][1:])
    print(f"{args.batch} requests x {args.max_tokens} tokens, {args.adapters} adapters of rank "
          f"{args.rank}, {model.cfg.architecture} ({path}), {jax.devices()[0].platform}; "
          f"median of {args.rounds} rounds, load average {min(loads):.1f}-{max(loads):.1f}")
    for name in engines:
        s = statistics.median(seconds[name][1:])
        print(f"  {name:14s} {s:7.2f} s  {tokens / s:8.1f} tok/s  {base / s:5.2f}x of base")
    last = f"lora-{args.impls.split(',')[-1]}"
    compiles = engines[last][0].engine.runner.num_compilations
    lora = engines[last][0].engine.runner.lora
    slot_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(lora.stacks)) // args.adapters
    extra = LoRARequest("extra", 99, write_random_adapter(os.path.join(tmp, "extra"),
                                                          model.cfg, args.rank, seed=99))
    start = time.perf_counter()
    weights = lora.manager.add(extra)
    read = time.perf_counter() - start
    start = time.perf_counter()
    lora.write(0, weights)
    jax.block_until_ready(lora.stacks)
    write = time.perf_counter() - start
    print(f"  one slot: {slot_bytes / 2**20:.1f} MiB on the device; loading an adapter: "
          f"{read * 1e3:.0f} ms to read, {write * 1e3:.0f} ms to write its slot; "
          f"compilations after warm-up ({last} engine): {compiles}")


if __name__ == "__main__":
    main()

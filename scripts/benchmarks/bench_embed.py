"""What pooling costs: `LLM(runner="pooling").embed` against the same prompts' prefill in a
generating engine (`generate` with `max_tokens=1`), on one loaded model, runs interleaved.

    python -m scripts.benchmarks.bench_embed --num-prompts 64 --prompt-len 128 --pooling-type LAST
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve import LLM, PoolingParams, SamplingParams
from models.loaders import load_model, load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--pooling-type", default="LAST", choices=("LAST", "MEAN", "CLS"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = p.parse_args()

    model, tokenizer = load_model(args.model, "float32"), load_tokenizer(args.model)
    sizes = dict(max_num_seqs=32, max_num_batched_tokens=args.max_num_batched_tokens,
                 max_model_len=max(256, 2 * args.prompt_len), enable_prefix_caching=False)
    pool = LLM(model, tokenizer=tokenizer, runner="pooling",
               pooler_config={"pooling_type": args.pooling_type}, **sizes)
    gen = LLM(model, tokenizer=tokenizer, **sizes)
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, args.prompt_len).tolist()}
               for _ in range(args.num_prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tokens = args.num_prompts * args.prompt_len
    times = {"embed": [], "prefill (generate, max_tokens=1)": []}
    for _ in range(args.rounds):
        start = time.perf_counter()
        pool.embed(prompts, PoolingParams(), use_tqdm=False)
        times["embed"].append(time.perf_counter() - start)
        start = time.perf_counter()
        gen.generate(prompts, greedy, use_tqdm=False)
        times["prefill (generate, max_tokens=1)"].append(time.perf_counter() - start)
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.pooling_type}, "
          f"budget {args.max_num_batched_tokens}; best of {args.rounds} (interleaved)")
    for name, ts in times.items():
        print(f"  {name:34s} {min(ts):7.3f} s  {tokens / min(ts):9.0f} prompt tok/s")
    print(f"  compilations after warm-up: pooling "
          f"{pool.get_metrics()['jaxserve:num_compilations']:.0f}, generate "
          f"{gen.get_metrics()['jaxserve:num_compilations']:.0f}")


if __name__ == "__main__":
    main()

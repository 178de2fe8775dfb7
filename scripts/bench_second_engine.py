"""What a second engine in the same process costs: construction with warm-up and one short
`generate`, for two engines built one after the other on the same model and limits.

Engines share their jitted programs (`jaxserve.runner.model_runner.shared_program`), so
the second compiles nothing; the first engine, measured in the same run, is the baseline.
Prints each engine's seconds, its JAX compilations (lowerings) and the ratio.

    python scripts/bench_second_engine.py [--model PATH] [--max-num-batched-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import time


def run(model: str | None, max_num_batched_tokens: int, max_model_len: int) -> list[dict]:
    """[{seconds, generate_seconds, compilations, tokens}] of two engines in turn."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner import compile_counter
    from models.loaders import load_model, load_tokenizer

    compile_counter.install()
    path = model
    if path is None:
        from models.default_model import default_model_path

        path = default_model_path()
    loaded, tokenizer = load_model(path), load_tokenizer(path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rows = []
    for _ in range(2):
        before, start = compile_counter.num_compilations(), time.perf_counter()
        llm = LLM(loaded, tokenizer=tokenizer, max_model_len=max_model_len, max_num_seqs=8,
                  max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=64)
        built = time.perf_counter()
        out = llm.generate(["Once upon a time", "The capital of France is"], params,
                           use_tqdm=False)
        rows.append({"seconds": built - start, "generate_seconds": time.perf_counter() - built,
                     "compilations": compile_counter.num_compilations() - before,
                     "tokens": [o.outputs[0].token_ids for o in out]})
        del llm
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded model)")
    p.add_argument("--max-num-batched-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    a = p.parse_args()
    rows = run(a.model, a.max_num_batched_tokens, a.max_model_len)
    for name, r in zip(("first engine", "second engine"), rows, strict=True):
        print(f"{name}: construct + warm-up {r['seconds']:.1f} s, generate "
              f"{r['generate_seconds']:.2f} s, {r['compilations']} compilations")
    print(f"second / first: {rows[1]['seconds'] / rows[0]['seconds']:.2f}x "
          f"(load average {os.getloadavg()[0]:.2f})")
    if rows[0]["tokens"] != rows[1]["tokens"]:
        raise SystemExit("the two engines gave different tokens")


if __name__ == "__main__":
    main()

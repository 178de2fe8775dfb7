"""Decode step of a Qwen3.5-shaped hybrid (3 of every 4 layers Gated DeltaNet) against an
all-attention model of the same size, at contexts of 1K and 16K tokens (issue 63's benchmark).

Three random-weight `Qwen3_5ForCausalLM` models share every width (hidden, MLP, heads) and
differ in their `layer_types` alone:

- "hybrid": `--layers` layers, every 4th gated full attention, the rest linear attention
  (Gated DeltaNet: a fixed-size state per request in the state pools, no pages);
- "all_attn": the same `--layers` layers all gated full attention (pages for every layer);
- "attn_only": the hybrid's full-attention layers alone (`--layers` / 4 of them), which
  splits the hybrid's step by difference: linear layers = hybrid - attn_only, the hybrid's
  attention layers = (all_attn - attn_only) * n_attn / (layers - n_attn) (all_attn's extra
  layers are attention layers at the same context), the rest (embedding, final norm, LM head
  and the step's fixed cost) = attn_only - the hybrid's attention layers.

The widths scale Qwen3.5's published ratios (transformers' `Qwen3_5TextConfig` default:
hidden 4096, 16 q / 4 kv heads of 256, 16 linear key / 32 value heads of 128, MLP 3 x hidden)
down to `--hidden`: hidden / 128 q heads and hidden / 512 kv heads of 128, hidden / 256
linear key heads and twice that value heads of 128, MLP 3 x hidden. Each decode step (`batch`
requests, one new token each after `context` computed tokens, each request on pages of its own
and in its own state slot) is compiled once per (model, context, batch) in an engine whose
`max_model_len` is that context plus the new token (block tables as wide as it needs) and
timed interleaved (A B C, C B A, ...: machine drift hits all alike, `bench_moe.interleaved_ms`).
The page pool holds just the pages the step reads (plus the null page; `--num-kv-blocks`
sets another size: a served engine fills its memory with pages). The pages hold zeros and
the state pools start at zero (the work does not depend on the values; the states fill as
the timed steps run). All serve on the `xla` backend (the `cpu`
backend's packed panels do not serve the hybrids: that would compare matmul kernels).

Usage: python -m scripts.benchmarks.bench_hybrid_decode [--contexts 1024,16384] [--batches 1,8]
       [--hidden 1024] [--layers 8] [--rounds 9] [--num-kv-blocks N]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from jaxserve.bench.engine_run import make_llm
from jaxserve.bench.roofline import decode_pages
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from models.default_model import default_model_path
from models.linear import ServingChoice
from models.loaders import load_tokenizer
from models.model import Model, random_params
from models.registry import arch_config_from_hf
from scripts.benchmarks.bench_moe import interleaved_ms

NAMES = ("hybrid", "all_attn", "attn_only")
PAGE = 16


def hf_configs(hidden: int, layers: int, vocab: int) -> dict[str, dict]:
    """The three models' transformers configs (`Qwen3_5ForCausalLM`), by name."""
    if hidden % 512 or layers % 4:
        raise ValueError(f"--hidden ({hidden}) must be a multiple of 512 and --layers "
                         f"({layers}) of 4 (one full-attention layer in every 4)")
    base = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
                intermediate_size=3 * hidden, num_attention_heads=hidden // 128,
                num_key_value_heads=hidden // 512, head_dim=128,
                linear_num_key_heads=hidden // 256, linear_num_value_heads=hidden // 128,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                max_position_embeddings=32768, tie_word_embeddings=False)
    hybrid = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    return {"hybrid": dict(base, num_hidden_layers=layers, layer_types=hybrid),
            "all_attn": dict(base, num_hidden_layers=layers,
                             layer_types=["full_attention"] * layers),
            "attn_only": dict(base, num_hidden_layers=layers // 4,
                              layer_types=["full_attention"] * (layers // 4))}


def decode_step(batch: int, context: int) -> SchedulerOutput:
    """`batch` decodes at `context`, request i on pages of its own and in state slot i + 1
    (slot 0 is the null slot; a model without a state group ignores the slot)."""
    pages = decode_pages(context, PAGE)
    return SchedulerOutput(scheduled=[
        ScheduledRequest(f"r{i}", [100 + 97 * i], context,
                         list(range(1 + pages * i, 1 + pages * (i + 1))), 1, state_slot=i + 1)
        for i in range(batch)])


def compiled(model: Model, tok, batch: int, context: int, num_pages: int | None = None):
    """[the runner's `ModelStep` of one decode step, its runner, the pool it updates], in an
    engine sized for `batch` requests at `context` (its block-table width, and its page pool
    unless `num_pages` is given)."""
    num_pages = num_pages or 1 + batch * decode_pages(context, PAGE)
    llm = make_llm(model, tok, max_model_len=context + 1, max_num_seqs=batch,
                   max_num_batched_tokens=max(batch, 16), block_size=PAGE,
                   num_kv_blocks=num_pages, warmup=False)
    runner = llm.engine.runner
    step = runner.prepare_model_step(decode_step(batch, context))
    pool, logits, _ = step.run(runner.params, runner.kv_pages)
    logits.block_until_ready()
    return [step, runner, pool]


def split(med: dict[str, float], layers: int) -> tuple[float, float, float]:
    """(the hybrid's linear layers, its attention layers, the rest) in ms, by difference of
    the three models' medians (module docstring)."""
    n_attn = layers // 4
    attn = (med["all_attn"] - med["attn_only"]) * n_attn / (layers - n_attn)
    return med["hybrid"] - med["attn_only"], attn, med["attn_only"] - attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--num-kv-blocks", type=int,
                    help="every engine's page pool (default: the pages its step holds)")
    args = ap.parse_args()
    try:
        cfgs = {n: arch_config_from_hf(c)
                for n, c in hf_configs(args.hidden, args.layers, args.vocab).items()}
    except ValueError as e:
        ap.error(str(e))
    tok = load_tokenizer(default_model_path())
    models = {n: Model(cfg, random_params(cfg, seed=0), serving=ServingChoice("xla"))
              for n, cfg in cfgs.items()}
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"hidden {args.hidden}, {args.layers} layers ({args.layers // 4} full attention), "
          f"{args.rounds} rounds, pages of {PAGE}, page pools of "
          f"{args.num_kv_blocks or 'the pages each step holds'}", flush=True)
    med: dict[tuple[int, int], dict[str, float]] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for context in contexts:
            steps = {n: compiled(models[n], tok, batch, context, args.num_kv_blocks)
                     for n in NAMES}
            times = interleaved_ms(steps, list(NAMES), args.rounds)
            m = med[batch, context] = {n: float(np.median(times[n])) for n in NAMES}
            print(f"batch {batch}, context {context}: " + ", ".join(
                f"{n} {m[n]:.2f} ms" for n in NAMES)
                + f"; hybrid / all_attn {m['hybrid'] / m['all_attn']:.2f}x; load "
                f"{os.getloadavg()[0]:.2f}", flush=True)
            del steps
    first, last = contexts[0], contexts[-1]
    print("\n| batch | context | hybrid ms | all-attention ms | hybrid / all-attention | "
          "hybrid's linear layers ms | its attention layers ms | rest ms |")
    print("|" + " --- |" * 8)
    for (batch, context), m in med.items():
        lin, attn, rest = split(m, args.layers)
        print(f"| {batch} | {context} | {m['hybrid']:.1f} | {m['all_attn']:.1f} | "
              f"{m['hybrid'] / m['all_attn']:.2f}x | {lin:.1f} | {attn:.1f} | {rest:.1f} |")
    if first != last:
        for batch in sorted({b for b, _ in med}):
            lo, hi = med[batch, first], med[batch, last]
            lin_lo, lin_hi = split(lo, args.layers)[0], split(hi, args.layers)[0]
            print(f"batch {batch}, {last} / {first}: hybrid {hi['hybrid'] / lo['hybrid']:.2f}x, "
                  f"all_attn {hi['all_attn'] / lo['all_attn']:.2f}x, hybrid's linear layers "
                  f"{lin_hi / lin_lo:.2f}x")


if __name__ == "__main__":
    main()

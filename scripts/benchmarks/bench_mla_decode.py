"""Decode step of a DeepSeek-V3-shaped MLA model in the absorbed form against the expanded one,
at contexts of 1K and 8K tokens (issue 64's benchmark).

One random-weight `DeepseekV3ForCausalLM` (DeepSeek-V3's attention ratios scaled down:
`--hidden` / 64 query heads, kv_lora_rank `--hidden` / 8, qk_rope_head_dim 32,
qk_nope_head_dim and v_head_dim 64, q_lora_rank `--hidden` / 4; the first layer's MLP dense
and the rest 8 routed experts, top 2, with a shared one) is served twice, the same weights
and latent pool layout, with `ArchConfig.mla_form` "absorbed" (queries into the latent space,
attention over the latents, W_UV after) and "expanded" (per-head keys and values rebuilt
from the gathered latents, then ordinary attention): `models.mla`. ("prefill_expanded" is
the absorbed form on a decode step.) Each decode step (`batch` requests, one new token each
after `context` computed tokens, on pages of their own) is compiled once per (form, context,
batch) by `bench_hybrid_decode.compiled` (block tables as wide as the context, a page pool
of just the pages the step reads) and timed interleaved (`bench_moe.interleaved_ms`). The
pages hold zeros: the work does not depend on the values. Both on the `xla` backend.

Usage: python -m scripts.benchmarks.bench_mla_decode [--contexts 1024,8192] [--batches 1,8]
       [--hidden 1024] [--layers 4] [--rounds 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from models.default_model import default_model_path
from models.linear import ServingChoice
from models.loaders import load_tokenizer
from models.model import Model, random_params
from models.registry import arch_config_from_hf
from scripts.benchmarks.bench_hybrid_decode import compiled
from scripts.benchmarks.bench_moe import interleaved_ms

FORMS = ("absorbed", "expanded")


def hf_config(hidden: int, layers: int, vocab: int) -> dict:
    """The model's transformers config (`DeepseekV3ForCausalLM`)."""
    if hidden % 256 or layers < 2:
        raise ValueError(f"--hidden ({hidden}) must be a multiple of 256 and --layers "
                         f"({layers}) at least 2 (a dense first layer, then experts)")
    return dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
                intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                kv_lora_rank=hidden // 8, q_lora_rank=hidden // 4, qk_rope_head_dim=32,
                qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
                n_group=1, topk_group=1, moe_intermediate_size=hidden // 2,
                first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=16384,
                tie_word_embeddings=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    try:
        cfg = arch_config_from_hf(hf_config(args.hidden, args.layers, args.vocab))
    except ValueError as e:
        ap.error(str(e))
    tok = load_tokenizer(default_model_path())
    params = random_params(cfg, seed=0)
    models = {f: Model(dataclasses.replace(cfg, mla_form=f), params,
                       serving=ServingChoice("xla")) for f in FORMS}
    print(f"hidden {args.hidden}, {args.layers} layers, {cfg.num_heads} heads, kv_lora_rank "
          f"{cfg.kv_lora_rank}, rope {cfg.head_dim}, nope {cfg.qk_nope_head_dim}, v "
          f"{cfg.v_head_dim}, {args.rounds} rounds", flush=True)
    med: dict[tuple[int, int], dict[str, float]] = {}
    loads: dict[tuple[int, int], float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            steps = {f: compiled(models[f], tok, batch, context) for f in FORMS}
            times = interleaved_ms(steps, list(FORMS), args.rounds)
            m = med[batch, context] = {f: float(np.median(times[f])) for f in FORMS}
            loads[batch, context] = os.getloadavg()[0]
            print(f"batch {batch}, context {context}: absorbed {m['absorbed']:.2f} ms, "
                  f"expanded {m['expanded']:.2f} ms; expanded / absorbed "
                  f"{m['expanded'] / m['absorbed']:.2f}x; load {loads[batch, context]:.2f}",
                  flush=True)
            del steps
    print("\n| batch | context | absorbed ms | expanded ms | expanded / absorbed | load |")
    print("|" + " --- |" * 6)
    for (batch, context), m in med.items():
        print(f"| {batch} | {context} | {m['absorbed']:.1f} | {m['expanded']:.1f} | "
              f"{m['expanded'] / m['absorbed']:.2f}x | {loads[batch, context]:.1f} |")


if __name__ == "__main__":
    main()

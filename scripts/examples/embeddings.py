"""A worked example: sentence embeddings from the pooling runner, and their cosine similarities.

An engine built with `runner="pooling"` embeds prompts instead of generating: each prompt's
final hidden states are pooled (`MEAN` here; `LAST` and `CLS` too) and L2-normalized, so a
dot product is the cosine similarity. Printed: each text's embedding size, the similarity
matrix, and a Matryoshka-shortened embedding (`PoolingParams(dimensions=...)`: the first
values, normalized again). On the embedded SmolLM2 (a generative model, not trained for
embeddings) or a random test model the similarities show the mechanics, not a quality.

Usage: python -m scripts.examples.embeddings [--model PATH] [--pooling-type MEAN|LAST|CLS]
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxserve import LLM, PoolingParams

TEXTS = ["The cat sat on the mat.", "A cat was sitting on a rug.",
         "Stock markets fell sharply today.", "Paris is the capital of France."]


def main(argv: list[str] | None = None) -> np.ndarray:
    """Embeds `TEXTS` and prints their cosine similarities.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        The similarity matrix, float[len(TEXTS), len(TEXTS)].
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model (default: SmolLM2)")
    ap.add_argument("--pooling-type", default="MEAN", choices=("MEAN", "LAST", "CLS"))
    ap.add_argument("--dimensions", type=int, default=32, help="the shortened embedding's size")
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args(argv)

    # Small engine sizes, and no warm-up: a short script compiles what it uses on first use.
    llm = LLM(args.model, runner="pooling", warmup=False,
              pooler_config={"pooling_type": args.pooling_type, "normalize": True},
              max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
              num_kv_blocks=256, attention_backend=args.attention_backend)
    outs = llm.embed(TEXTS, use_tqdm=False)
    vectors = np.array([o.outputs.embedding for o in outs])  # [texts, hidden], unit rows
    similarity = vectors @ vectors.T
    print(f"{len(TEXTS)} texts -> embeddings of {vectors.shape[1]} values "
          f"({args.pooling_type} pooling, normalized)")
    for text, row in zip(TEXTS, similarity, strict=True):
        print(f"  {text[:34]:34s} " + " ".join(f"{s:6.3f}" for s in row))
    short = llm.embed(TEXTS[0], PoolingParams(dimensions=args.dimensions), use_tqdm=False)
    values = np.array(short[0].outputs.embedding)
    print(f"Matryoshka: the first {len(values)} values, norm {np.linalg.norm(values):.4f}")
    return similarity


if __name__ == "__main__":
    main()

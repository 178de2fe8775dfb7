"""Cross-encoder pairs per second: `LLM.score` (the pooling runner) against transformers' own
`BertForSequenceClassification` batched forward, on one random-weight BERT, runs interleaved
A/B/A/B with the load average beside each.

The model is MiniLM-L6-shaped by default (ms-marco-MiniLM-L-6-v2's: hidden 384, 6 layers, 12
heads, MLP 1536) with SmolLM2's vocabulary, float32; the pairs are one query against
`--num-pairs` documents of about `--doc-len` tokens. Both sides tokenize inside the timing.

    python -m scripts.benchmarks.bench_cross_encoder --num-pairs 128 --doc-len 96 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def main() -> None:
    import torch
    import transformers

    from jaxserve import LLM
    from jaxserve.bench.pair_tokenizer import pair_tokenizer
    from models.loaders import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-pairs", type=int, default=128)
    p.add_argument("--doc-len", type=int, default=96, help="about this many tokens a document")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--hf-batch", type=int, default=32, help="transformers' batch size")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    root = tempfile.mkdtemp(prefix="bench_cross_encoder.")
    tok = pair_tokenizer(load_tokenizer(None), root)
    config = transformers.BertConfig(
        vocab_size=49152, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
        max_position_embeddings=512, num_labels=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(config).to(torch.float32).eval()
    hf.save_pretrained(root, safe_serialization=True)

    rng = np.random.default_rng(0)
    words = sorted(w for w in tok.get_vocab() if w.isalpha() and len(w) > 3)[:5000]
    query = "what is the capital of france and why is it famous"
    docs = [" ".join(rng.choice(words, args.doc_len)) for _ in range(args.num_pairs)]

    llm = LLM(root, runner="pooling", max_num_seqs=64, max_model_len=512,
              max_num_batched_tokens=args.max_num_batched_tokens, warmup=False)

    def run_jaxserve() -> list[float]:
        return [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]

    def run_transformers() -> list[float]:
        out = []
        with torch.no_grad():
            for i in range(0, len(docs), args.hf_batch):
                part = docs[i:i + args.hf_batch]
                enc = tok([query] * len(part), part, padding=True, truncation=True,
                          max_length=511, return_token_type_ids=True, return_tensors="pt")
                out += torch.sigmoid(hf(**enc).logits[:, 0]).tolist()
        return out

    # NOTE: untimed: compiles the step shapes this workload meets (warm-up off: it would also
    # compile programs a pooling run never calls) and warms both.
    a, b = run_jaxserve(), run_transformers()
    print(f"max |score difference| {max(abs(x - y) for x, y in zip(a, b, strict=True)):.2e}")
    n_tokens = sum(len(tok(query, d).input_ids) for d in docs)
    times: dict[str, list[float]] = {"jaxserve LLM.score": [], "transformers batched": []}
    loads = []
    for _ in range(args.rounds):
        for name, fn in (("jaxserve LLM.score", run_jaxserve),
                         ("transformers batched", run_transformers)):
            loads.append(os.getloadavg()[0])
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"{args.num_pairs} pairs ({n_tokens / args.num_pairs:.0f} tokens each), BERT "
          f"hidden {args.hidden} x {args.layers} layers, float32, {os.cpu_count()} CPUs; "
          f"{args.rounds} interleaved rounds, load {min(loads):.1f}-{max(loads):.1f}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} median {med:7.3f} s  {args.num_pairs / med:8.1f} pairs/s  "
              f"(rounds: {', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()

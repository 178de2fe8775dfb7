"""Host cost of stop strings per generated token (issue 50 item 3): one request's
`IncrementalDetokenizer.update` over a long generation, with many or long stop strings that
never match, beside the same generation with none (the baseline, measured in the same run)."""

from __future__ import annotations

import argparse
import os
import random
import time

from jaxserve.engine.detokenizer import IncrementalDetokenizer


def per_token_us(tokenizer, ids: list[int], stop: list[str], rounds: int) -> float:
    """Best-of-`rounds` microseconds per token of feeding `ids` one at a time."""
    best = float("inf")
    for _ in range(rounds):
        det = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop=stop)
        start = time.perf_counter()
        for t in ids:
            det.update([t])
            det.get_next_output_text(False, True)
        best = min(best, (time.perf_counter() - start) / len(ids))
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2000, help="generation length (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="best of (default 3)")
    args = p.parse_args()
    from models.default_model import default_model_path
    from models.loaders import load_tokenizer

    tok = load_tokenizer(default_model_path())
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from it an be this".split()
    text = " ".join(rng.choice(words) for _ in range(args.tokens * 2))
    ids = tok(text, add_special_tokens=False).input_ids[:args.tokens]

    def never(n: int, length: int) -> list[str]:  # strings the text cannot hold
        return [f"\x01{i:0{length - 1}d}"[:length] if length > 1 else "\x01" for i in range(n)]

    cases = [("none", [])] + [(f"{n} x {length} chars", never(n, length))
                              for n, length in ((4, 10), (16, 10), (64, 10), (256, 10),
                                                (1024, 10), (10_000, 10), (16, 1000),
                                                (1, 10_000), (1, 1_000_000))]
    base = None
    print(f"{len(ids)} tokens, best of {args.rounds}; load average "
          f"{os.getloadavg()[0]:.2f}")
    print("| stop strings | us/token | vs none |")
    print("|---|---|---|")
    for name, stop in cases:
        us = per_token_us(tok, ids, stop, args.rounds)
        base = base or us
        print(f"| {name} | {us:.1f} | {us / base:.2f}x |")


if __name__ == "__main__":
    main()

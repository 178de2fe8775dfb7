"""N-gram proposals against a brute-force oracle written separately, loop by loop."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.spec_decode.ngram import propose_ngram


def oracle(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule stated plainly: longest n first; among its earlier occurrences the latest
    with k tokens after it, else the earliest."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        starts = [s for s in range(0, length - n) if tokens[s:s + n] == suffix]
        if not starts:
            continue
        full = [s for s in starts if s + n + k <= length]
        s = full[-1] if full else starts[0]
        return tokens[s + n:s + n + k]
    return []


def test_examples():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3).tolist() == [4, 5, 1]
    # The longest suffix wins over a later shorter one.
    assert propose_ngram([5, 6, 7, 8, 0, 6, 7, 9, 5, 6, 7], 2, 1, 3).tolist() == [8, 0]
    assert propose_ngram([1, 2, 3], 2, 1, 2).tolist() == []  # nothing recurs
    assert propose_ngram([4, 4], 3, 1, 3).tolist() == [4]  # continuation shorter than k
    assert propose_ngram([9], 3, 1, 3).tolist() == []
    assert propose_ngram([1, 2, 1, 2], 2, 3, 4).tolist() == []  # below min_n


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_matches_the_oracle_on_random_histories(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(300):
        tokens = rng.integers(0, vocab, rng.integers(1, 40)).tolist()
        k, lo = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        assert propose_ngram(tokens, k, lo, hi).tolist() == oracle(tokens, k, lo, hi), \
            (tokens, k, lo, hi)


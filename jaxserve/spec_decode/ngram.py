"""N-gram (prompt lookup) proposals: continue the text where its suffix occurred before."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int] | np.ndarray, k: int, min_n: int,
                  max_n: int) -> np.ndarray:
    """Up to `k` proposed tokens for a request whose tokens so far are `token_ids`.

    The longest suffix n-gram of the history (`min_n <= n <= max_n`) is looked up among
    its earlier positions; the proposal is what followed it there. Among equally long
    matches the latest one whose continuation holds all `k` tokens wins (else the
    earliest, whose continuation is longest). One vectorized pass per n: no per-token
    Python loop.

    Args:
        token_ids: Prompt plus output tokens of the request.
        k: Proposals wanted.
        min_n: Shortest suffix that may match.
        max_n: Longest suffix tried.

    Returns:
        i32[<= k] proposed tokens; empty when no suffix of `min_n` tokens recurs.
    """
    t = np.asarray(token_ids, dtype=np.int64)  # i64[L]
    length = t.size
    empty = np.zeros(0, np.int32)
    if k < 1 or length < min_n + 1:
        return empty
    ends = np.arange(length - 1)  # i64[L-1]: where an earlier occurrence may end
    run = np.zeros(length - 1, np.int64)  # i64[L-1]: suffix tokens matched backwards
    alive = np.ones(length - 1, bool)
    for i in range(min(max_n, length - 1)):
        back = ends - i
        alive &= back >= 0
        alive[alive] = t[back[alive]] == t[length - 1 - i]
        if not alive.any():
            break
        run += alive
    best = int(run.max())
    if best < min_n:
        return empty
    hits = np.flatnonzero(run == best)  # i64[hits], ascending
    full = hits[hits + 1 + k <= length]
    j = int(full[-1]) if full.size else int(hits[0])
    return t[j + 1:j + 1 + k].astype(np.int32)


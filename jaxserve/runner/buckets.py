"""Padded step sizes: the small fixed set of token counts a jitted step is compiled for."""

from __future__ import annotations

import bisect

# Smallest token bucket unless the caller says otherwise (the runner takes its backend's
# from `pallas_kernels.tuning`).
MIN_BUCKET = 16


def token_buckets(max_num_batched_tokens: int, min_bucket: int = MIN_BUCKET,
                  gap: int = 256) -> list[int]:
    """Powers of two from `min_bucket` up to `gap`, then steps of `gap`, up to the budget.

    The last entry is always `max_num_batched_tokens` rounded up to the list's grain, so
    every step fits some bucket.

    Raises:
        ValueError: A non-positive size, a gap that is not a power of two, or a
            `min_bucket` above the gap.
    """
    if max_num_batched_tokens < 1 or min_bucket < 1:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) and min_bucket "
                         f"({min_bucket}) must be positive")
    if gap < 1 or gap & (gap - 1):  # NOTE: 0 passes the bit test and would loop forever
        raise ValueError(f"bucket gap must be a power of two, got {gap}")
    if min_bucket > gap:
        raise ValueError(f"min_bucket ({min_bucket}) must not exceed the gap ({gap})")
    buckets = []
    size = 1 << (min_bucket - 1).bit_length()
    while size < min(gap, max_num_batched_tokens):
        buckets.append(size)
        size *= 2
    if max_num_batched_tokens <= gap:
        buckets.append(size)
        return buckets
    size = gap
    while size < max_num_batched_tokens:
        buckets.append(size)
        size += gap
    buckets.append(size)
    return buckets


def pick_bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket >= n.

    Raises:
        ValueError: n exceeds the largest bucket.
    """
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def rows_for_bucket(num_tokens: int, max_num_seqs: int) -> int:
    """Request rows of a step padded to `num_tokens` tokens: min(num_tokens, max_num_seqs).

    NOTE: tying the request count to the token bucket keeps one bucket list (one compile
    per token bucket) instead of a product of two lists.
    """
    return min(num_tokens, max_num_seqs)

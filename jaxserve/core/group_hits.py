"""Prefix-cache hits across KV cache groups: the longest prefix every group can serve.

A full-attention group serves a prefix of k pages when it holds all k; a sliding-window
group (window w) when it holds the pages the next query reads, those covering positions
k * page_size - w + 1 .. k * page_size - 1 (its earlier pages may be long gone). The hit
is the largest k every group serves: the full groups' leading run bounds it, then each
sliding group lowers it to where its window's pages are all cached, until no group
lowers it further (vLLM's hybrid manager decides the same way).
"""

from __future__ import annotations

from collections.abc import Callable

from jaxserve.core.kv_page import KVPage


def first_key(num_tokens: int, window: int) -> int:
    """Position of the first key a query at position `num_tokens` reads in a group of
    `window`: 0 for full attention, p - w + 1 for a sliding window w, and the start of its
    chunk, floor(p / C) * C, for a negative window -C (Llama 4's chunked local attention)."""
    if window > 0:
        return max(0, num_tokens - window + 1)
    if window < 0:
        return num_tokens // -window * -window
    return 0


def window_start(num_pages: int, window: int, page_size: int) -> int:
    """First page a sliding or chunked group needs for a query after `num_pages` full
    pages."""
    return first_key(num_pages * page_size, window) // page_size


def find_group_hits(lookup: Callable[[int, int], KVPage | None], windows: tuple[int, ...],
                    max_pages: int, page_size: int, bound: Callable[[int], int] | None = None
                    ) -> tuple[int, list[list[KVPage | None]]]:
    """The longest prefix hit every group serves.

    Args:
        lookup: `lookup(group, index)` is the cached page of that group at that table
            index for the request's tokens, or None.
        windows: Per group, its sliding window (0: full attention; -C: chunks of C).
        max_pages: Most pages a hit may cover.
        page_size: Tokens per page.
        bound: `bound(k)` is the longest hit of at most k pages something besides the
            pages allows (a state group's snapshots: `StateSnapshots.longest`); None: k.

    Returns:
        (k, pages): the hit's page count and, per group, its k table entries (None where
        a sliding group's window does not reach).
    """
    k = max_pages
    found: dict[tuple[int, int], KVPage | None] = {}

    def get(g: int, i: int) -> KVPage | None:
        if (g, i) not in found:
            found[g, i] = lookup(g, i)
        return found[g, i]

    for g, w in enumerate(windows):
        if w == 0:
            k = next((i for i in range(k) if get(g, i) is None), k)
    changed = True
    while changed and k > 0:
        changed = False
        if bound is not None:
            k = bound(k)
        for g, w in enumerate(windows):
            if w == 0:
                continue
            i = k - 1
            while k > 0 and i >= window_start(k, w, page_size):
                if get(g, i) is None:
                    k, changed = i, True  # every hit longer than i needs page i
                i -= 1
    pages = []
    for g, w in enumerate(windows):
        start = window_start(k, w, page_size) if w else 0
        pages.append([None] * start + [get(g, i) for i in range(start, k)])
    return k, pages

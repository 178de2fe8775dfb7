"""KV cache accounting: running counters and the snapshot the metrics module reads."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class KVCacheCounters:
    """Monotonic counters the KV cache manager bumps as it works.

    Prefix queries and hits are counted in tokens, as vLLM does: a query is a lookup for
    a request's tokens, a hit the tokens served from cached pages.
    """

    prefix_queries: int = 0
    prefix_hits: int = 0
    num_cow_copies: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swapped_out_pages: int = 0
    num_swapped_in_pages: int = 0
    num_swap_fallbacks: int = 0


@dataclass(frozen=True)
class KVCacheStats:
    """A point-in-time view of the KV cache.

    The device pool's usable pages split three ways:
    `num_free_pages + num_cached_pages + num_used_pages == num_total_pages`.

    Attributes:
        num_total_pages: Usable device pages (the null page excluded).
        num_free_pages: Unowned pages with no reusable content.
        num_cached_pages: Unowned pages holding a reusable prefix (evictable).
        num_used_pages: Pages owned by at least one request.
        usage: `num_used_pages / num_total_pages`.
        num_allocated_slots: Token slots in used pages.
        num_token_slots: Slots of used pages holding (or about to hold) a token.
        internal_fragmentation: `1 - num_token_slots / num_allocated_slots` (0 if none).
        num_total_host_slots: Host swap slots.
        num_free_host_slots: Host swap slots not holding a swapped page.
        prefix_queries: Tokens looked up in the prefix cache.
        prefix_hits: Tokens served from cached pages.
        prefix_hit_rate: `prefix_hits / prefix_queries` (0 if no queries).
        num_cow_copies: Pages copied for copy-on-write.
        num_swap_outs: Requests swapped out.
        num_swap_ins: Requests swapped in.
        num_swapped_out_pages: Pages moved device -> host.
        num_swapped_in_pages: Pages moved host -> device.
        num_swap_fallbacks: Swap-outs refused for lack of host slots (caller recomputes).
    """

    num_total_pages: int
    num_free_pages: int
    num_cached_pages: int
    num_used_pages: int
    usage: float
    num_allocated_slots: int
    num_token_slots: int
    internal_fragmentation: float
    num_total_host_slots: int
    num_free_host_slots: int
    prefix_queries: int
    prefix_hits: int
    prefix_hit_rate: float
    num_cow_copies: int
    num_swap_outs: int
    num_swap_ins: int
    num_swapped_out_pages: int
    num_swapped_in_pages: int
    num_swap_fallbacks: int


def count_token_slots(tables: Iterable[tuple[list[int], int]],
                      page_size: int) -> tuple[int, int]:
    """Allocated slots and slots holding a token over the distinct pages of all tables.

    NOTE: a page shared by several tables (prefix hit, fork) is counted once, as full as
    its fullest holder, so sharing never inflates either figure.

    Args:
        tables: (page ids, tokens the request keeps in them) for every request.
        page_size: Slots per page.

    Returns:
        (num_allocated_slots, num_token_slots).
    """
    filled: dict[int, int] = {}
    for page_ids, num_tokens in tables:
        for index, page_id in enumerate(page_ids):
            in_page = min(page_size, max(0, num_tokens - index * page_size))
            if in_page > filled.get(page_id, -1):
                filled[page_id] = in_page
    return len(filled) * page_size, sum(filled.values())


def make_stats(*, num_total_pages: int, num_cached_pages: int, num_used_pages: int,
               num_allocated_slots: int, num_token_slots: int, num_total_host_slots: int,
               num_free_host_slots: int, counters: KVCacheCounters) -> KVCacheStats:
    """Builds a `KVCacheStats` from raw figures, deriving the ratios."""
    queries = counters.prefix_queries
    return KVCacheStats(
        num_total_pages=num_total_pages,
        num_free_pages=num_total_pages - num_cached_pages - num_used_pages,
        num_cached_pages=num_cached_pages,
        num_used_pages=num_used_pages,
        usage=num_used_pages / num_total_pages,
        num_allocated_slots=num_allocated_slots,
        num_token_slots=num_token_slots,
        internal_fragmentation=(1.0 - num_token_slots / num_allocated_slots
                                if num_allocated_slots else 0.0),
        num_total_host_slots=num_total_host_slots,
        num_free_host_slots=num_free_host_slots,
        prefix_queries=queries,
        prefix_hits=counters.prefix_hits,
        prefix_hit_rate=counters.prefix_hits / queries if queries else 0.0,
        num_cow_copies=counters.num_cow_copies,
        num_swap_outs=counters.num_swap_outs,
        num_swap_ins=counters.num_swap_ins,
        num_swapped_out_pages=counters.num_swapped_out_pages,
        num_swapped_in_pages=counters.num_swapped_in_pages,
        num_swap_fallbacks=counters.num_swap_fallbacks,
    )

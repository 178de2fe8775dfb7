"""The attention ranks' pools and KV statistics seen as one (`RankedKVCacheManager`'s `pool`,
`host_pool` and `stats()`): read-only sums for the metrics, the engine and the tests."""

from __future__ import annotations

import dataclasses

from jaxserve.core.kv_metrics import KVCacheCounters, KVCacheStats, make_stats
from jaxserve.core.page_pool import HostPool, PagePool
from jaxserve.core.prefix_cache import PrefixCache


def _summed(name: str, doc: str) -> property:
    return property(lambda self: sum(getattr(part, name) for part in self.parts), doc=doc)


class RankedPagePool:
    """The ranks' device pools as one: each figure is the sum over the ranks.

    Args:
        parts: Each rank's `PagePool`, rank by rank.
    """

    def __init__(self, parts: list[PagePool]):
        self.parts = parts

    num_pages = _summed("num_pages", "Device pages of all ranks, each rank's null page included.")
    num_usable_pages = _summed("num_usable_pages", "Pages of all ranks less their null pages.")
    num_used_pages = _summed("num_used_pages", "Pages owned by requests, on all ranks.")
    num_allocatable_pages = _summed("num_allocatable_pages",
                                    "Pages that could be handed out now, on all ranks.")
    num_cached_free_pages = _summed("num_cached_free_pages",
                                    "Unowned pages holding a reusable prefix, on all ranks.")

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Rank 0's prefix cache: None when prefix caching is off (on every rank alike)."""
        return self.parts[0].prefix_cache


class RankedHostPool:
    """The ranks' host swap pools as one (sums).

    Args:
        parts: Each rank's `HostPool`, rank by rank.
    """

    def __init__(self, parts: list[HostPool]):
        self.parts = parts

    num_slots = _summed("num_slots", "Host swap slots of all ranks.")
    num_free_slots = _summed("num_free_slots", "Host swap slots of all ranks not holding a page.")


def summed_stats(parts: list[KVCacheStats]) -> KVCacheStats:
    """One `KVCacheStats` of the ranks' own: counts and counters summed, ratios of the sums."""
    def total(name: str) -> int:
        return sum(getattr(part, name) for part in parts)

    counters = KVCacheCounters(**{f.name: total(f.name)
                                  for f in dataclasses.fields(KVCacheCounters)})
    return make_stats(num_total_pages=total("num_total_pages"),
                      num_cached_pages=total("num_cached_pages"),
                      num_used_pages=total("num_used_pages"),
                      num_allocated_slots=total("num_allocated_slots"),
                      num_token_slots=total("num_token_slots"),
                      num_total_host_slots=total("num_total_host_slots"),
                      num_free_host_slots=total("num_free_host_slots"), counters=counters)

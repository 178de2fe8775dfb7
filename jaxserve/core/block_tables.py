"""Per-request block tables over the device and host pools: free, fork, plans, stats."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.core.block_pool import NULL_PAGE_ID, BlockPool, HostPool, KVPage
from jaxserve.core.kv_metrics import KVCacheCounters, KVCacheStats, count_token_slots, make_stats
from jaxserve.core.plans import KVPlans, PendingPlans
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.request import Request


@dataclass
class SwappedKV:
    """What a swapped-out request keeps: its host slots in logical order and progress."""

    slot_ids: list[int]
    num_cached_pages: int
    num_slot_tokens: int


class BlockTables:
    """The state under `KVCacheManager`: block tables, pools, pending plans, counters.

    Holds what every request owns and releases it; allocation and swap policy live in
    `KVCacheManager`. Constructor arguments are documented there.
    """

    def __init__(self, num_pages: int, page_size: int = 16, *, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, swap_space: float = 0.0, bytes_per_page: int = 0,
                 max_model_len: int | None = None):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must lie in [0, 1), got {watermark}")
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_pages, enable_caching=enable_prefix_caching)
        self.host_pool = HostPool.from_swap_space(swap_space, bytes_per_page)
        self.watermark_pages = int(watermark * self.pool.num_usable_pages)
        self.counters = KVCacheCounters()
        self._tables: dict[str, list[KVPage]] = {}
        self._num_cached_pages: dict[str, int] = {}  # leading pages offered to the cache
        self._num_slot_tokens: dict[str, int] = {}  # tokens the request keeps in its pages
        self._swapped: dict[str, SwappedKV] = {}
        self._pending = PendingPlans()
        # request id -> (request, tokens its pages will hold) to index at take_plans().
        self._cache_on_take: dict[str, tuple[Request, int]] = {}

    # ----------------------------------------------------------------- lookups
    def has_request(self, request_id: str) -> bool:
        """Whether the request holds device pages or host slots."""
        return request_id in self._tables or request_id in self._swapped

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's KV sits in the host pool."""
        return request_id in self._swapped

    def block_ids(self, request_id: str) -> list[int]:
        """The request's page ids in logical order. Raises ValueError if unknown."""
        return [page.page_id for page in self._table(request_id)]

    def get_block_table(self, request: Request, max_num_pages: int | None = None) -> np.ndarray:
        """The block table as i32, padded with the null page to `max_num_pages` if given.

        Raises:
            ValueError: Unknown request, or more pages than `max_num_pages`.
        """
        page_ids = self.block_ids(request.request_id)
        width = len(page_ids) if max_num_pages is None else max_num_pages
        if len(page_ids) > width:
            raise ValueError(f"request {request.request_id!r} holds {len(page_ids)} pages, "
                             f"more than max_num_pages={width}")
        table = np.full(width, NULL_PAGE_ID, dtype=np.int32)
        table[:len(page_ids)] = page_ids
        return table

    @property
    def usage(self) -> float:
        """Fraction of usable pages owned by requests."""
        return self.pool.num_used_pages / self.pool.num_usable_pages

    @property
    def num_allocatable_pages(self) -> int:
        """Pages an allocation may take now (free plus evictable cached)."""
        return self.pool.num_allocatable_pages

    def free(self, request: Request) -> None:
        """Releases a finished, aborted or recompute-preempted request's pages or slots.

        Pages go back tail first, so the request's tail is evicted before its head; cached
        pages stay reusable until evicted.

        Raises:
            ValueError: The request holds nothing (unknown or already freed).
        """
        request_id = request.request_id
        if request_id in self._swapped:
            slot_ids = self._swapped.pop(request_id).slot_ids
            self._pending.drop_swap_out_slots(slot_ids)
            self.host_pool.free(slot_ids)
            return
        self._release(reversed(self._table(request_id)))
        self._forget(request_id)

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's pages, shared by reference count (n > 1, beams).

        Raises:
            ValueError: Unknown or swapped parent, a child that already holds KV, or a child
                whose progress or computed tokens differ from the parent's.
        """
        parent_table = self._table(parent.request_id)
        if self.has_request(child.request_id):
            raise ValueError(f"cannot fork into {child.request_id!r}: it already holds KV")
        num_computed = parent.num_computed_tokens
        if (child.num_computed_tokens != num_computed
                or child.all_token_ids[:num_computed] != parent.all_token_ids[:num_computed]):
            raise ValueError(f"child {child.request_id!r} must match parent "
                             f"{parent.request_id!r} in computed tokens (use Request.fork)")
        self.pool.touch(parent_table)
        self._tables[child.request_id] = list(parent_table)
        self._num_cached_pages[child.request_id] = self._num_cached_pages.get(parent.request_id, 0)
        self._num_slot_tokens[child.request_id] = self._num_slot_tokens.get(parent.request_id, 0)

    # ---------------------------------------------------------- step / metrics
    def take_plans(self) -> KVPlans:
        """Drains this step's swap and copy plans for the runner; call once per step.

        NOTE: only now are copy sources unpinned and swap-in host slots reusable, because
        only now has the runner been handed the moves that read them. Pages filled this
        step join the prefix cache now too, not at allocation: a request freed or swapped
        out later in the same scheduling pass never computes its pages, and nobody may
        have hit them meanwhile.
        """
        for request, num_tokens in self._cache_on_take.values():
            self._register_full_pages(request, num_tokens)
        self._cache_on_take.clear()
        plans, pinned_ids, deferred_slot_ids = self._pending.take()
        self.pool.free_pages(self.pool.pages[page_id] for page_id in pinned_ids)
        self.host_pool.free(deferred_slot_ids)
        return plans

    def evict_cached_pages(self, max_num_pages: int | None = None) -> int:
        """Forgets up to `max_num_pages` unowned cached pages (all if None), LRU first."""
        return self.pool.evict_cached_pages(max_num_pages)

    def stats(self) -> KVCacheStats:
        """A snapshot of usage, fragmentation, prefix, copy-on-write and swap figures."""
        num_allocated, num_token_slots = count_token_slots(
            {rid: [p.page_id for p in table] for rid, table in self._tables.items()},
            self._num_slot_tokens, self.page_size)
        return make_stats(
            num_total_pages=self.pool.num_usable_pages,
            num_cached_pages=self.pool.num_cached_free_pages,
            num_used_pages=self.pool.num_used_pages,
            num_allocated_slots=num_allocated, num_token_slots=num_token_slots,
            num_total_host_slots=self.host_pool.num_slots,
            num_free_host_slots=self.host_pool.num_free_slots, counters=self.counters)

    # ---------------------------------------------------------------- helpers
    def _table(self, request_id: str) -> list[KVPage]:
        table = self._tables.get(request_id)
        if table is None:
            state = "is swapped out" if request_id in self._swapped else "holds no pages"
            raise ValueError(f"request {request_id!r} {state}")
        return table

    def _swapped_request(self, request_id: str) -> SwappedKV:
        swapped = self._swapped.get(request_id)
        if swapped is None:
            raise ValueError(f"request {request_id!r} is not swapped out")
        return swapped

    def _forget(self, request_id: str) -> None:
        del self._tables[request_id]
        self._num_cached_pages.pop(request_id, None)
        self._num_slot_tokens.pop(request_id, None)
        self._cache_on_take.pop(request_id, None)

    def _release(self, ordered_pages) -> None:
        for page in self.pool.free_pages(ordered_pages):
            self._pending.drop_page(page.page_id)

    def _num_holders(self, page: KVPage) -> int:
        return page.ref_cnt - self._pending.num_pins(page.page_id)

    def _cache_full_pages(self, request: Request, num_tokens: int) -> None:
        """Queues the request's pages covering `num_tokens` for indexing at take_plans()."""
        if self.pool.prefix_cache is not None:
            self._cache_on_take[request.request_id] = (request, num_tokens)

    def _register_full_pages(self, request: Request, num_tokens: int) -> None:
        """Offers the request's newly full pages (covering `num_tokens`) to the cache."""
        request_id, ps = request.request_id, self.page_size
        table = self._tables[request_id]
        start = self._num_cached_pages.get(request_id, 0)
        num_full = min(num_tokens // ps, len(table))
        if num_full <= start:
            return
        hashes = update_page_hashes(request, ps)
        token_ids = request.all_token_ids
        for index in range(start, num_full):
            self.pool.cache_full_page(table[index], hashes[index],
                                      token_ids[index * ps:(index + 1) * ps])
        self._num_cached_pages[request_id] = num_full

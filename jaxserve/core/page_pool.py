"""Device page pool (ref counts, LRU free list, null page 0) and the host swap-slot pool."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from jaxserve.core.kv_page import NULL_PAGE_ID, KVPage, PageHash
from jaxserve.core.prefix_cache import PrefixCache


class FreePageQueue:
    """Doubly linked list of unowned pages in eviction order (head is evicted first).

    NOTE: a plain deque cannot drop a page from the middle in O(1), which a prefix-cache
    hit on an unowned page needs; sentinels keep every link update branch-free.
    """

    def __init__(self, pages: Iterable[KVPage] = ()):
        self._head = KVPage(-1)
        self._tail = KVPage(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_pages = 0
        for page in pages:
            self.append(page)

    def __len__(self) -> int:
        return self.num_pages

    def __iter__(self) -> Iterator[KVPage]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def _insert_after(self, prev: KVPage, page: KVPage) -> None:
        nxt = prev.next_free
        page.prev_free, page.next_free = prev, nxt
        prev.next_free = page
        nxt.prev_free = page
        self.num_pages += 1

    def append(self, page: KVPage) -> None:
        """Adds `page` at the tail (evicted last)."""
        self._insert_after(self._tail.prev_free, page)

    def appendleft(self, page: KVPage) -> None:
        """Adds `page` at the head (evicted first)."""
        self._insert_after(self._head, page)

    def remove(self, page: KVPage) -> None:
        """Unlinks `page` in O(1)."""
        if page.prev_free is None or page.next_free is None:
            raise ValueError(f"page {page.page_id} is not in the free queue")
        page.prev_free.next_free = page.next_free
        page.next_free.prev_free = page.prev_free
        page.prev_free = page.next_free = None
        self.num_pages -= 1

    def popleft(self) -> KVPage:
        """Removes and returns the head page."""
        if self.num_pages == 0:
            raise ValueError("the free queue is empty")
        page = self._head.next_free
        self.remove(page)
        return page


class PagePool:
    """All device pages, created once; page 0 is the null page and never handed out.

    Unowned pages sit in the free queue: pages with no reusable content at the head,
    prefix-cached pages at the tail in the order their owners released them, so the
    least recently used cached page is evicted first.

    Args:
        num_pages: Pages in the device pool, the null page included (at least 2).
        enable_caching: Whether full pages are indexed for prefix reuse.

    Raises:
        ValueError: `num_pages` < 2.
    """

    def __init__(self, num_pages: int, enable_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (the null page plus one), got {num_pages}")
        self.num_pages = num_pages
        self.pages = [KVPage(i) for i in range(num_pages)]
        self.null_page = self.pages[NULL_PAGE_ID]
        self.free_queue = FreePageQueue(self.pages[1:])
        self.prefix_cache = PrefixCache() if enable_caching else None
        self.num_cached_free_pages = 0

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_allocatable_pages(self) -> int:
        """Unowned pages, cached ones included (they are evicted on demand)."""
        return len(self.free_queue)

    @property
    def num_used_pages(self) -> int:
        """Pages with at least one owner."""
        return self.num_usable_pages - len(self.free_queue)

    def get_new_pages(self, num_pages: int) -> list[KVPage]:
        """Hands out `num_pages` pages (ref count 1), evicting cached content they held.

        Raises:
            ValueError: Negative count or fewer unowned pages than asked for.
        """
        if num_pages < 0 or num_pages > len(self.free_queue):
            raise ValueError(f"cannot hand out {num_pages} pages: "
                             f"{len(self.free_queue)} unowned pages left")
        pages = []
        for _ in range(num_pages):
            page = self.free_queue.popleft()
            self.evict_page(page)
            page.ref_cnt = 1
            pages.append(page)
        return pages

    def touch(self, pages: Iterable[KVPage]) -> None:
        """Adds an owner to each page (prefix hit, fork), reclaiming unowned ones."""
        for page in pages:
            if page.ref_cnt == 0:
                self.free_queue.remove(page)
                if page.page_hash is not None:
                    self.num_cached_free_pages -= 1
            page.ref_cnt += 1

    def free_pages(self, ordered_pages: Iterable[KVPage]) -> list[KVPage]:
        """Drops one owner from each page; returns those that became unowned.

        Args:
            ordered_pages: Pages in eviction order (callers pass a block table tail first).
        """
        released = []
        for page in ordered_pages:
            if page.ref_cnt <= 0 or page.is_null:
                raise ValueError(f"page {page.page_id} freed more often than it was owned")
            page.ref_cnt -= 1
            if page.ref_cnt == 0:
                released.append(page)
                if page.page_hash is None:
                    # NOTE: no reusable content, so it is the cheapest page to hand out.
                    self.free_queue.appendleft(page)
                else:
                    self.free_queue.append(page)
                    self.num_cached_free_pages += 1
        return released

    def cache_full_page(self, page: KVPage, page_hash: PageHash, token_ids: list[int]) -> bool:
        """Indexes a full, owned page for prefix reuse; False if caching is off or taken."""
        if self.prefix_cache is None:
            return False
        return self.prefix_cache.insert(page, page_hash, token_ids)

    def get_cached_page(self, page_hash: PageHash, token_ids: list[int]) -> KVPage | None:
        """The cached page holding exactly these tokens after this prefix, or None."""
        if self.prefix_cache is None:
            return None
        return self.prefix_cache.lookup(page_hash, token_ids)

    def evict_cached_pages(self, max_num_pages: int | None = None) -> int:
        """Forgets the content of up to `max_num_pages` unowned cached pages, LRU first."""
        victims = [p for p in self.free_queue if p.page_hash is not None]
        if max_num_pages is not None:
            victims = victims[:max(0, max_num_pages)]
        for page in victims:
            self.evict_page(page)
        return len(victims)

    def evict_page(self, page: KVPage) -> bool:
        """Drops one page from the prefix cache (owned or not); False if it was not cached."""
        if self.prefix_cache is None or not self.prefix_cache.evict(page):
            return False
        if page.ref_cnt == 0:
            self.num_cached_free_pages -= 1
        return True


class HostPool:
    """Host-memory swap slots, one device page each.

    Args:
        num_slots: Number of slots (0 disables swapping).

    Raises:
        ValueError: Negative `num_slots`.
    """

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # NOTE: a stack, so recently freed (warm) host memory is reused first.
        self._free_slot_ids = list(range(num_slots - 1, -1, -1))

    @classmethod
    def from_swap_space(cls, swap_space_gib: float, bytes_per_page: int) -> HostPool:
        """Sizes the pool from `swap_space` GiB and the bytes one page holds (all layers).

        Raises:
            ValueError: Negative swap space, or swap space with `bytes_per_page` <= 0.
        """
        if swap_space_gib < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {swap_space_gib}")
        if swap_space_gib == 0:
            return cls(0)
        if bytes_per_page <= 0:
            raise ValueError(f"bytes_per_page must be positive to size swap, got {bytes_per_page}")
        return cls(int(swap_space_gib * 2**30) // bytes_per_page)

    @property
    def num_free_slots(self) -> int:
        """Slots not holding a swapped page."""
        return len(self._free_slot_ids)

    def allocate(self, num_slots: int) -> list[int]:
        """Takes `num_slots` slots. Raises ValueError when fewer are free."""
        if num_slots < 0 or num_slots > len(self._free_slot_ids):
            raise ValueError(f"cannot take {num_slots} host slots: "
                             f"{len(self._free_slot_ids)} free")
        return [self._free_slot_ids.pop() for _ in range(num_slots)]

    def free(self, slot_ids: Iterable[int]) -> None:
        """Returns slots to the pool."""
        self._free_slot_ids.extend(slot_ids)

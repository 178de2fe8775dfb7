"""Unit tests for the device page pool, its LRU free queue, the prefix index and host slots."""

from __future__ import annotations

import pytest

from jaxserve.core.kv_page import NULL_PAGE_ID, KVPage
from jaxserve.core.page_pool import FreePageQueue, HostPool, PagePool
from jaxserve.core.prefix_cache import PrefixCache, hash_page_tokens, update_page_hashes
from jaxserve.request import Request


def ids(pages) -> list[int]:
    return [page.page_id for page in pages]


def test_free_queue_order_and_o1_removal():
    pages = [KVPage(i) for i in range(1, 6)]
    queue = FreePageQueue(pages)
    assert ids(queue) == [1, 2, 3, 4, 5] and len(queue) == 5
    queue.remove(pages[2])  # page 3, from the middle
    queue.appendleft(pages[2])
    queue.append(queue.popleft())  # 3 to the tail
    assert ids(queue) == [1, 2, 4, 5, 3]
    assert pages[2].next_free is not None and len(queue) == 5


def test_free_queue_errors():
    queue = FreePageQueue()
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(KVPage(7))


def test_null_page_is_never_handed_out():
    pool = PagePool(5)
    pages = pool.get_new_pages(4)
    assert NULL_PAGE_ID not in ids(pages)
    assert pool.null_page.is_null and pool.null_page.ref_cnt == 0
    assert pool.num_allocatable_pages == 0 and pool.num_used_pages == 4
    with pytest.raises(ValueError, match="cannot hand out 1 pages"):
        pool.get_new_pages(1)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_pages([pool.null_page])


@pytest.mark.parametrize("num_pages", [0, 1, -3])
def test_pool_needs_two_pages(num_pages):
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PagePool(num_pages)


def test_negative_page_count_and_double_free():
    pool = PagePool(4)
    with pytest.raises(ValueError, match="cannot hand out -1 pages"):
        pool.get_new_pages(-1)
    (page,) = pool.get_new_pages(1)
    pool.free_pages([page])
    with pytest.raises(ValueError, match=f"page {page.page_id} freed more often"):
        pool.free_pages([page])


def test_free_order_uncached_first_then_lru_cached():
    pool = PagePool(6)
    a, b, c, d = pool.get_new_pages(4)
    pool.cache_full_page(a, b"A" * 32, [1])
    pool.cache_full_page(b, b"B" * 32, [2])
    released = pool.free_pages([b, a])  # a table [a, b] released tail first
    assert ids(released) == [b.page_id, a.page_id]
    pool.free_pages([c])  # uncached: jumps to the head
    assert ids(pool.free_queue) == [c.page_id, 5, b.page_id, a.page_id]
    assert pool.num_cached_free_pages == 2
    # Reuse hands out the uncached pages first, then evicts the LRU cached page (b).
    got = pool.get_new_pages(3)
    assert ids(got) == [c.page_id, 5, b.page_id]
    assert b.page_hash is None and pool.get_cached_page(b"B" * 32, [2]) is None
    assert pool.get_cached_page(b"A" * 32, [1]) is a
    assert pool.num_cached_free_pages == 1 and d.ref_cnt == 1


def test_touch_reclaims_cached_page_from_the_middle():
    pool = PagePool(5)
    pages = pool.get_new_pages(4)
    for i, page in enumerate(pages):
        pool.cache_full_page(page, bytes([i]) * 32, [i])
    pool.free_pages(pages)
    pool.touch([pages[1], pages[2]])
    assert ids(pool.free_queue) == [pages[0].page_id, pages[3].page_id]
    assert pages[1].ref_cnt == 1 and pool.num_cached_free_pages == 2
    pool.touch([pages[1]])
    assert pages[1].ref_cnt == 2


def test_evict_cached_pages_lru_first():
    pool = PagePool(5)
    pages = pool.get_new_pages(4)
    for i, page in enumerate(pages):
        pool.cache_full_page(page, bytes([i]) * 32, [i])
    pool.free_pages(pages)
    assert pool.evict_cached_pages(2) == 2
    assert [p.page_hash is None for p in pages] == [True, True, False, False]
    assert pool.evict_cached_pages() == 2 and pool.num_cached_free_pages == 0
    assert len(pool.prefix_cache) == 0 and pool.num_allocatable_pages == 4


def test_caching_disabled():
    pool = PagePool(3, enable_caching=False)
    (page,) = pool.get_new_pages(1)
    assert not pool.cache_full_page(page, b"x" * 32, [1])
    assert pool.get_cached_page(b"x" * 32, [1]) is None
    assert pool.evict_cached_pages() == 0


def test_prefix_cache_requires_matching_tokens_and_unique_hash():
    cache = PrefixCache()
    page, other = KVPage(1), KVPage(2)
    h = hash_page_tokens(None, [1, 2, 3, 4])
    assert cache.insert(page, h, [1, 2, 3, 4])
    assert cache.lookup(h, [1, 2, 3, 4]) is page
    assert cache.lookup(h, [1, 2, 3, 5]) is None  # a hash "collision" never hits
    assert not cache.insert(other, h, [1, 2, 3, 4])  # one page per hash
    assert not cache.insert(page, b"y" * 32, [9])  # a page has one hash
    assert cache.evict(page) and not cache.evict(page) and len(cache) == 0


def test_chained_hash_depends_on_parent_and_extra_keys():
    first = hash_page_tokens(None, [1, 2])
    assert len(first) == 32
    assert hash_page_tokens(first, [3, 4]) != hash_page_tokens(None, [3, 4])
    assert hash_page_tokens(None, [1, 2], ("salt", "a")) != first
    assert hash_page_tokens(None, [1, 2], ("salt", "a")) != hash_page_tokens(
        None, [1, 2], ("salt", "b"))


def test_update_page_hashes_is_incremental():
    request = Request("r", [5, 6, 7, 8, 9], cache_salt="t")
    assert len(update_page_hashes(request, 2)) == 2
    request.append_output_token_ids([10, 11, 12])
    incremental = list(update_page_hashes(request, 2))
    fresh = Request("s", [5, 6, 7, 8, 9, 10, 11, 12], cache_salt="t")
    assert incremental == update_page_hashes(fresh, 2) and len(incremental) == 4


def test_host_pool_sizing_and_errors():
    assert HostPool.from_swap_space(1.0, 2**20).num_slots == 1024
    assert HostPool.from_swap_space(0, 0).num_slots == 0
    with pytest.raises(ValueError, match="swap_space must be >= 0"):
        HostPool.from_swap_space(-1, 2**20)
    with pytest.raises(ValueError, match="bytes_per_page must be positive"):
        HostPool.from_swap_space(1.0, 0)
    with pytest.raises(ValueError, match="num_slots must be >= 0"):
        HostPool(-1)
    host = HostPool(3)
    slots = host.allocate(2)
    assert slots == [0, 1] and host.num_free_slots == 1
    with pytest.raises(ValueError, match="cannot take 2 host slots"):
        host.allocate(2)
    host.free(slots)
    assert host.num_free_slots == 3

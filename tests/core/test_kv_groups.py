"""The hybrid KV cache on the host: sliding groups give pages back while a request runs,
prefix hits every group serves, swap, forks and admission counted over all groups."""

from __future__ import annotations

import random

import pytest

from jaxserve.core import KVCacheManager
from jaxserve.core.group_hits import find_group_hits, window_start
from jaxserve.request import Request
from tests.core.kv_helpers import PS, admit, decode

WINDOWS = (0, 6, 6)  # one full group, two sliding groups of window 6 (page size 4)


def make(num_pages: int = 49, **kwargs) -> KVCacheManager:
    kwargs.setdefault("watermark", 0.0)
    return KVCacheManager(num_pages, PS, group_windows=WINDOWS, **kwargs)


def held(manager: KVCacheManager, rid: str) -> list[int]:
    """Non-null pages of each group."""
    return [sum(1 for p in manager.page_ids(rid, g) if p) for g in range(manager.num_groups)]


def test_pages_go_back_during_a_long_decode_and_all_at_the_end():
    manager = make()
    request = Request("a", list(range(10, 18)))  # 8 tokens: 2 pages
    admit(manager, request)
    used = []
    for step in range(40):
        decode(manager, request, 100 + step)
        used.append(manager.pool.num_used_pages)
        full, *sliding = held(manager, "a")
        # the full group holds every page; each sliding group what covers the window
        assert full == -(-request.num_computed_tokens // PS)
        first = max(0, request.num_computed_tokens - 6 + 1) // PS  # the next query's window
        for g in (1, 2):
            ids = manager.page_ids("a", g)
            assert ids[:max(0, (request.num_computed_tokens - 6) // PS)] == [0] * max(
                0, (request.num_computed_tokens - 6) // PS)
            assert 0 not in ids[first:]
        assert max(sliding) <= 3  # window 6 plus the page being filled
    # usage grows by one full page per 4 tokens, not three
    assert used[-1] - used[3] <= (40 - 4) // PS + 2
    stats = manager.stats()
    assert stats.num_used_pages == manager.pool.num_used_pages
    manager.free(request)
    manager.take_plans()
    assert manager.usage == 0.0 and manager.pool.num_used_pages == 0


def test_a_chunk_longer_than_the_window_holds_its_pages_for_one_step():
    manager = make()
    request = Request("a", list(range(10, 34)))  # 24 tokens
    admit(manager, request, 20)  # one chunk of 20: every page is read within the step
    assert held(manager, "a") == [5, 5, 5]
    admit_rest = manager.allocate_slots(request, 4)
    request.num_computed_tokens += 4
    assert admit_rest is not None
    # the next query is at 20: window 6 reads 15..20, pages 3.. only
    assert [manager.page_ids("a", g)[:3] for g in (1, 2)] == [[0, 0, 0], [0, 0, 0]]
    assert held(manager, "a") == [6, 3, 3]


def test_prefix_hit_takes_only_the_window_of_sliding_groups():
    manager = make()
    prompt = list(range(10, 31))  # 21 tokens: 5 full pages, hit at most 5 pages
    first = Request("a", prompt)
    admit(manager, first)
    decode(manager, first, 7)
    manager.free(first)
    manager.take_plans()
    second = Request("b", prompt + [1, 2])
    hit_ids, num_hit = manager.get_computed_pages(second)
    assert num_hit == 5 * PS
    full, slide1, slide2 = hit_ids
    assert len(full) == 5 and 0 not in full
    # a query at 20 with window 6 reads 15..20: pages 3 and 4
    assert slide1[:3] == [0, 0, 0] and 0 not in slide1[3:]
    assert slide2[:3] == [0, 0, 0] and 0 not in slide2[3:]
    new_ids = manager.allocate_slots(second, second.num_tokens - num_hit, num_hit, hit_ids)
    assert new_ids is not None and len(new_ids) == 3  # one new page per group
    assert manager.page_ids("b", 1)[:5] == slide1


def test_a_sliding_group_missing_a_window_page_shortens_the_hit():
    manager = make()
    prompt = list(range(10, 31))
    first = Request("a", prompt)
    admit(manager, first)
    table = manager.page_ids("a", 2)
    decode(manager, first, 7)  # gives back pages 0..3 of the sliding groups (still cached)
    assert manager.page_ids("a", 2)[:4] == [0] * 4
    sliding_page = table[4]  # page 4 of group 2, inside every window
    manager.free(first)
    manager.take_plans()
    manager.pool.evict_page(manager.pool.pages[sliding_page])
    second = Request("b", prompt + [1, 2])
    hit_ids, num_hit = manager.get_computed_pages(second)
    # a hit of 5 pages needs page 4; of 4 pages, pages 2 and 3 (positions 11..15)
    assert num_hit == 4 * PS
    assert hit_ids[2] == [0, 0] + table[2:4]
    assert len(hit_ids[0]) == 4 and 0 not in hit_ids[0]


def _serves(cached, windows, ps, n) -> bool:
    """Whether every group holds what a hit of n pages needs (the definition)."""
    return all(cached[g, i] for g, w in enumerate(windows)
               for i in range(window_start(n, w, ps) if w else 0, n))


def test_hit_search_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        windows = tuple(rng.choice([0, 0, 3, 5, 9]) for _ in range(rng.randint(1, 4)))
        max_pages, ps = rng.randint(0, 12), rng.choice([1, 2, 4])
        cached = {(g, i): rng.random() < 0.85 for g in range(len(windows))
                  for i in range(max_pages)}
        k, pages = find_group_hits(lambda g, i, c=cached: object() if c[g, i] else None,
                                   windows, max_pages, ps)
        assert k == max(n for n in range(max_pages + 1) if _serves(cached, windows, ps, n))
        for g, w in enumerate(windows):
            start = window_start(k, w, ps) if w else 0
            assert len(pages[g]) == k and pages[g][:start] == [None] * start
            assert None not in pages[g][start:]


def test_swap_keeps_the_null_entries_and_moves_only_held_pages():
    manager = make(swap_space=1.0, bytes_per_page=2**30 // 64)
    request = Request("a", list(range(10, 18)))
    admit(manager, request)
    for step in range(12):
        decode(manager, request, 100 + step)
    tables = [manager.page_ids("a", g) for g in range(3)]
    plan = manager.swap_out(request)
    assert len(plan.pairs) == sum(1 for t in tables for p in t if p)
    manager.take_plans()
    assert manager.pool.num_used_pages == 0
    back = manager.swap_in(request)
    assert len(back.pairs) == len(plan.pairs)
    after = [manager.page_ids("a", g) for g in range(3)]
    assert [[p == 0 for p in t] for t in after] == [[p == 0 for p in t] for t in tables]
    starts, _ = zip(*manager.page_deltas("a"), strict=True)
    assert starts == (0, 0, 0)  # the runner gets whole tables again


def test_fork_shares_every_group_and_each_child_drops_its_own():
    manager = make()
    parent = Request("p", list(range(10, 20)))
    admit(manager, parent)
    decode(manager, parent, 5)
    child = parent.fork("c")
    manager.fork(parent, child)
    for g in range(3):
        assert manager.page_ids("c", g) == manager.page_ids("p", g)
    for step in range(10):
        decode(manager, parent, 50 + step)
        decode(manager, child, 60 + step)
    for g in (1, 2):
        assert manager.page_ids("p", g)[0] == 0 and manager.page_ids("c", g)[0] == 0
    manager.free(parent)
    manager.free(child)
    manager.take_plans()
    assert manager.pool.num_used_pages == 0


def test_admission_counts_every_group():
    one = KVCacheManager(49, PS, watermark=0.0, max_model_len=4096)
    hybrid = KVCacheManager(49, PS, watermark=0.0, max_model_len=4096, group_windows=WINDOWS,
                            max_chunk_tokens=8)
    # 48 pages: one group holds 192 tokens. Hybrid: a step of 8 new tokens after a window
    # of 6 spans 13 positions, at most 5 pages per sliding group; the rest is the full one's.
    assert one.max_tokens_per_request == 48 * PS
    assert hybrid.max_tokens_per_request == (48 - 2 * 5) * PS
    assert hybrid.pages_for_tokens(hybrid.max_tokens_per_request) <= 48
    assert hybrid.pages_for_tokens(hybrid.max_tokens_per_request + 1) > 48
    sliding = KVCacheManager(9, PS, watermark=0.0, max_model_len=4096, group_windows=(6,),
                             max_chunk_tokens=8)
    assert sliding.max_tokens_per_request == 4096  # every layer sliding: any length fits


def test_hit_ids_of_the_wrong_shape_are_an_error():
    manager = make()
    first = Request("a", list(range(10, 31)))
    admit(manager, first)
    decode(manager, first, 7)
    manager.free(first)
    manager.take_plans()
    second = Request("b", list(range(10, 31)) + [3])
    hit_ids, num_hit = manager.get_computed_pages(second)
    with pytest.raises(ValueError, match="one per KV cache group"):
        manager.allocate_slots(second, 2, num_hit, hit_ids[:2])
    with pytest.raises(ValueError, match="one window per KV cache group"):
        KVCacheManager(9, PS, group_windows=())
    with pytest.raises(ValueError, match="page id 0, outside"):  # a null page in a full group
        manager.allocate_slots(second, 2, num_hit, (hit_ids[1], hit_ids[0], hit_ids[2]))
    with pytest.raises(ValueError, match="not the cached page"):  # another group's pages
        manager.allocate_slots(second, 2, num_hit, (hit_ids[0], hit_ids[2], hit_ids[1]))
    assert manager.allocate_slots(second, 2, num_hit, hit_ids) is not None

"""Unit tests for KVCacheManager: prefix hits, eviction, fork/CoW, swap, failures, stats."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.core import KVCacheManager
from jaxserve.request import Request, RequestStatus
from tests.core.kv_helpers import PS, admit, decode, make, snapshot


def test_core_does_not_import_jax():
    code = ("import sys, jaxserve.core.kv_cache_manager, jaxserve.request; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_request_status_finished_is_one_comparison():
    finished = [s for s in RequestStatus if RequestStatus.is_finished(s)]
    assert all(s > RequestStatus.PREEMPTED for s in finished)
    assert RequestStatus.FINISHED_ABORTED in finished and RequestStatus.SWAPPED not in finished
    request = Request("r", [1])
    request.status = RequestStatus.FINISHED_STOPPED
    assert request.is_finished()


def test_prefix_hit_across_requests_with_shared_system_prompt():
    manager = make()
    system = list(range(100, 112))  # three full pages
    first = Request("a", system + [1, 2, 3])
    _, first_ids = admit(manager, first)
    second = Request("b", system + [7, 8])
    hit_ids, new_ids = admit(manager, second)
    assert hit_ids == first_ids[:3]
    assert manager.page_ids("b")[:3] == hit_ids and len(new_ids) == 1
    assert all(manager.pool.pages[i].ref_cnt == 2 for i in hit_ids)
    stats = manager.stats()
    assert stats.prefix_queries == 15 + 14 and stats.prefix_hits == 12
    assert stats.prefix_hit_rate == pytest.approx(12 / 29)
    # A shared page is one page: 5 distinct pages hold 12 + 3 + 2 tokens.
    assert stats.num_used_pages == 5 and stats.num_token_slots == 17


def test_hit_is_capped_so_the_last_token_is_computed():
    manager = make()
    prompt = list(range(12))  # exactly three pages
    admit(manager, Request("a", prompt))
    hit_ids, num_hit = manager.get_computed_pages(Request("b", prompt))
    assert len(hit_ids) == 2 and num_hit == 8
    hit_ids, num_hit = manager.get_computed_pages(Request("c", prompt + [99]))
    assert len(hit_ids) == 3 and num_hit == 12


def test_pages_join_the_cache_only_at_take_plans():
    manager = make()
    request = Request("a", list(range(9)))
    manager.allocate_slots(request, 9)
    assert manager.get_computed_pages(Request("b", list(range(9)))) == ([], 0)
    manager.take_plans()
    assert manager.get_computed_pages(Request("c", list(range(9))))[1] == 8


def test_equal_page_after_a_different_prefix_does_not_hit():
    manager = make()
    admit(manager, Request("a", [1, 1, 1, 1, 2, 2, 2, 2, 9]))
    assert manager.get_computed_pages(Request("b", [2, 2, 2, 2, 5])) == ([], 0)


def test_cache_salt_isolates_tenants():
    manager = make()
    prompt = list(range(9))
    admit(manager, Request("a", prompt, cache_salt="tenant-1"))
    assert manager.get_computed_pages(Request("b", prompt, cache_salt="tenant-2")) == ([], 0)
    assert manager.get_computed_pages(Request("c", prompt)) == ([], 0)
    assert manager.get_computed_pages(Request("d", prompt, cache_salt="tenant-1"))[1] == 8


def test_lru_eviction_tail_pages_before_head():
    manager = make(num_pages=5)  # four usable pages
    first = Request("a", list(range(13)))  # three full pages and a partial one
    admit(manager, first)
    head_ids = manager.page_ids("a")
    manager.free(first)
    # The uncached partial page goes first, then the request's tail.
    assert [p.page_id for p in manager.pool.free_queue] == head_ids[::-1]
    assert manager.stats().num_cached_pages == 3
    _, new_ids = admit(manager, Request("b", [500, 501, 502, 503, 504]))
    assert new_ids == [head_ids[3], head_ids[2]]
    hit_ids, num_hit = manager.get_computed_pages(Request("c", list(range(13))))
    assert hit_ids == head_ids[:2] and num_hit == 8


def test_lru_eviction_across_requests():
    manager = make(num_pages=7)
    older, newer = Request("a", list(range(9))), Request("b", list(range(50, 59)))
    admit(manager, older)
    admit(manager, newer)
    manager.free(older)
    manager.free(newer)
    assert manager.evict_cached_pages(2) == 2  # the older request's pages
    assert manager.get_computed_pages(Request("c", list(range(9)))) == ([], 0)
    assert manager.get_computed_pages(Request("d", list(range(50, 59))))[1] == 8


def test_fork_then_copy_on_write_plan():
    manager = make()
    parent = Request("p", [1, 2, 3, 4, 5, 6])  # one full page, one with two tokens
    admit(manager, parent)
    full_id, partial_id = manager.page_ids("p")
    child = parent.fork("c")
    manager.fork(parent, child)
    assert manager.pool.pages[partial_id].ref_cnt == 2
    new_ids = decode(manager, child, 7)
    assert len(new_ids) == 1 and manager.page_ids("c") == [full_id, new_ids[0]]
    assert manager.page_ids("p") == [full_id, partial_id]
    # The parent is now the partial page's only table holder: it writes in place.
    assert decode(manager, parent, 8) == []
    plans = manager.take_plans()
    assert plans.copy.pairs == [(partial_id, new_ids[0])]
    assert plans.copy.as_array().tolist() == [[partial_id, new_ids[0]]]
    assert plans.swap_out.pairs == [] and plans.swap_in.pairs == []
    assert manager.pool.pages[full_id].ref_cnt == 2
    assert manager.pool.pages[partial_id].ref_cnt == 1  # the copy's pin is gone
    assert manager.stats().num_cow_copies == 1


def test_fork_at_page_boundary_needs_no_copy():
    manager = make()
    parent = Request("p", list(range(8)))
    admit(manager, parent)
    child = parent.fork("c")
    manager.fork(parent, child)
    assert len(decode(manager, child, 9)) == 1
    assert manager.take_plans().copy.pairs == []


def test_swap_out_of_fresh_cow_page_reads_the_copy_source():
    manager = make(swap_space=1.0, bytes_per_page=2**26)
    parent = Request("p", [1, 2, 3, 4, 5, 6])
    admit(manager, parent)
    partial_id = manager.page_ids("p")[1]
    child = parent.fork("c")
    manager.fork(parent, child)
    decode(manager, child, 7)
    child.num_computed_tokens -= 1  # the step did not run for it
    plan = manager.swap_out(child)
    assert plan.pairs[1][0] == partial_id  # not the never-filled copy
    assert manager.take_plans().copy.pairs == []


def test_swap_out_of_a_copy_of_a_page_still_swapping_in_falls_back():
    manager = make(swap_space=1.0, bytes_per_page=2**26)
    parent = Request("p", [1, 2, 3, 4, 5, 6])
    admit(manager, parent)
    manager.swap_out(parent)
    manager.take_plans()
    manager.swap_in(parent)  # same step: fork, copy-on-write, swap out the child
    child = parent.fork("c")
    manager.fork(parent, child)
    decode(manager, child, 7)
    child.num_computed_tokens -= 1
    before = snapshot(manager)
    assert manager.swap_out(child) is None
    assert manager.counters.num_swap_fallbacks == 1
    before.pop("counters")
    after = snapshot(manager)
    after.pop("counters")
    assert after == before


def test_swap_out_then_swap_in_restores_the_logical_table():
    manager = make(swap_space=1.0, bytes_per_page=2**26, enable_prefix_caching=False)
    request = Request("r", list(range(10)))
    admit(manager, request)
    before = manager.page_ids("r")
    out = manager.swap_out(request)
    assert manager.is_swapped("r") and [d for d, _ in out.pairs] == before
    with pytest.raises(ValueError, match="is swapped out"):
        manager.page_ids("r")
    assert manager.take_plans().swap_out.pairs == out.pairs
    assert manager.stats().num_used_pages == 0
    back = manager.swap_in(request)
    after = manager.page_ids("r")
    assert len(after) == len(before)
    assert back.pairs == [(slot, page) for (_, slot), page in zip(out.pairs, after, strict=True)]
    assert manager.take_plans().swap_in.pairs == back.pairs
    stats = manager.stats()
    assert (stats.num_swap_outs, stats.num_swap_ins) == (1, 1)
    assert stats.num_swapped_out_pages == stats.num_swapped_in_pages == 3
    assert stats.num_free_host_slots == stats.num_total_host_slots == 16


def test_swap_falls_back_to_recompute_when_host_is_short():
    manager = make(swap_space=2 * 2**26 / 2**30, bytes_per_page=2**26)  # two host slots
    request = Request("r", list(range(10)))  # three pages
    admit(manager, request)
    before = snapshot(manager)
    assert not manager.can_swap_out(request)
    assert manager.swap_out(request) is None
    after = snapshot(manager)
    assert after.pop("counters").num_swap_fallbacks == 1
    before.pop("counters")
    assert after == before


def test_swap_in_waits_for_device_pages():
    manager = make(num_pages=4, swap_space=1.0, bytes_per_page=2**26)
    request = Request("r", list(range(10)))
    admit(manager, request)
    manager.swap_out(request)
    manager.take_plans()
    admit(manager, Request("x", [7]))
    before = snapshot(manager)
    assert not manager.can_swap_in(request) and manager.swap_in(request) is None
    assert snapshot(manager) == before
    manager.free(request)  # an aborted swapped request gives its host slots back
    assert manager.stats().num_free_host_slots == 16


def test_allocation_failure_returns_none_without_side_effects():
    manager = make(num_pages=12, swap_space=1.0, bytes_per_page=2**26)  # 11 usable pages
    shared = Request("s", list(range(9)))  # two full pages and a partial one
    admit(manager, shared)
    old = Request("old", list(range(100, 108)))
    admit(manager, old)
    manager.free(old)  # two cached, unowned pages
    child = shared.fork("c")
    manager.fork(shared, child)
    decode(manager, child, 42)  # copy-on-write: a pending copy and a pinned source
    big = Request("big", list(range(8)) + list(range(200, 232)))  # 10 pages, 2 of them hit
    hit_ids, num_hit = manager.get_computed_pages(big)
    assert num_hit == 8 and manager.pool.num_allocatable_pages == 7
    before = snapshot(manager)
    assert manager.allocate_slots(big, big.num_tokens - num_hit, num_hit, hit_ids) is None
    assert snapshot(manager) == before
    # The copy-on-write path fails cleanly too.
    grand = child.fork("g")
    manager.fork(child, grand)
    assert manager.allocate_slots(Request("fill", list(range(300, 328))), 28) is not None
    assert manager.pool.num_allocatable_pages == 0
    grand.append_output_token_ids(1)
    before = snapshot(manager)
    assert manager.allocate_slots(grand, 1) is None
    assert snapshot(manager) == before


def test_watermark_applies_to_admission_only():
    manager = KVCacheManager(11, PS, watermark=0.2)  # 10 usable pages, 2 held back
    running = Request("run", list(range(4)))
    admit(manager, running)  # 1 page; 9 left
    assert manager.allocate_slots(Request("new", list(range(32))), 32) is None  # 8 + 2 > 9
    fits = Request("new", list(range(28)))
    assert manager.allocate_slots(fits, 28) is not None  # 7 + 2 <= 9
    manager.free(fits)
    running.append_output_token_ids(list(range(32)))
    assert len(manager.allocate_slots(running, 32)) == 8  # a running request may dip in


def test_stats_fragmentation_and_partition():
    manager = make()
    request = Request("r", list(range(10)))
    admit(manager, request)
    stats = manager.stats()
    assert (stats.num_allocated_slots, stats.num_token_slots) == (12, 10)
    assert stats.internal_fragmentation == pytest.approx(2 / 12)
    assert stats.num_free_pages + stats.num_cached_pages + stats.num_used_pages == 16
    assert stats.usage == pytest.approx(3 / 16)
    manager.free(request)
    stats = manager.stats()
    assert (stats.num_used_pages, stats.num_cached_pages, stats.internal_fragmentation) == (
        0, 2, 0.0)


def test_aborting_a_scheduled_request_uncaches_its_unwritten_pages():
    manager = make()
    request = Request("r", list(range(9)))
    manager.allocate_slots(request, 9)
    manager.free(request)  # before the step ran: nothing was written
    manager.take_plans()
    assert manager.get_computed_pages(Request("s", list(range(9)))) == ([], 0)

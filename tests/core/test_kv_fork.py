"""Forks from a prefix of another request's KV: `KVCacheManager.fork` of a child computed up
to part of its parent's tokens, `can_fork`, and `Scheduler.add_request(kv_from=...)`
checked step by step by the harness (every query reads its own prefix's KV)."""

from __future__ import annotations

import pytest

from jaxserve.core import KVCacheManager
from jaxserve.request import Request, RequestStatus
from tests.core.kv_helpers import PS, admit, decode, make
from tests.core.scheduler_harness import Harness, make_request, make_scheduler


def _child(parent: Request, request_id: str, num_shared: int, tail: list[int]) -> Request:
    child = Request(request_id, parent.all_token_ids[:num_shared] + tail)
    child.num_computed_tokens = num_shared
    return child


def test_a_prefix_fork_shares_the_pages_of_the_childs_tokens_and_copies_on_write():
    manager = make()
    parent = Request("p", list(range(10)))  # pages of 4, 4 and 2 tokens
    admit(manager, parent)
    first, second, third = manager.page_ids("p")
    child = _child(parent, "c", 6, [99])  # shares 6 tokens: pages 1 and 2 (half)
    assert manager.can_fork(parent, 6)
    manager.fork(parent, child)
    assert manager.page_ids("c") == [first, second]
    refs = [manager.pool.pages[i].ref_cnt for i in (first, second, third)]
    assert refs == [2, 2, 1]
    new_ids = manager.allocate_slots(child, 1)  # token 99 at position 6: in the shared page
    assert len(new_ids) == 1 and manager.page_ids("c") == [first, new_ids[0]]
    assert manager.take_plans().copy.pairs == [(second, new_ids[0])]
    assert manager.page_ids("p") == [first, second, third]  # the parent's are unchanged
    assert manager.stats().num_cow_copies == 1
    manager.free(parent)
    manager.free(child)
    manager.take_plans()
    assert manager.pool.num_used_pages == 0


def test_prefix_fork_refusals():
    manager = make(swap_space=1.0, bytes_per_page=2**26)
    parent = Request("p", list(range(8)))
    admit(manager, parent, 6)  # two tokens not computed yet
    with pytest.raises(ValueError, match="must match parent 'p' in its computed tokens"):
        manager.fork(parent, _child(parent, "none", 0, [1]))  # shares nothing
    with pytest.raises(ValueError, match="must match parent 'p' in its computed tokens"):
        manager.fork(parent, _child(parent, "past", 7, [1]))  # past the parent's progress
    other = Request("o", [5, 1, 2, 3, 9])
    other.num_computed_tokens = 4
    with pytest.raises(ValueError, match="must match parent 'p' in its computed tokens"):
        manager.fork(parent, other)  # other tokens
    assert not manager.can_fork(parent, 7) and manager.can_fork(parent, 6)
    assert not manager.can_fork(Request("ghost", [1, 2]), 1)
    manager.swap_out(parent)
    assert not manager.can_fork(parent, 4)
    assert not manager.has_request("none") and not manager.has_request("o")


def test_a_prefix_fork_needs_the_sliding_pages_its_window_reads():
    manager = KVCacheManager(49, PS, watermark=0.0, group_windows=(0, 6))
    parent = Request("p", list(range(10, 20)))
    admit(manager, parent)
    for step in range(8):  # the window moves on: the sliding group gives pages back
        decode(manager, parent, 50 + step)
    assert manager.page_ids("p", 1)[0] == 0
    assert not manager.can_fork(parent, 8)  # its window would read the pages given back
    with pytest.raises(ValueError, match="gave back pages a sliding window still reads"):
        manager.fork(parent, _child(parent, "c", 8, [1]))
    num = parent.num_computed_tokens - 1  # 17: its window starts in the 4th page
    assert manager.can_fork(parent, num) and not manager.can_fork(parent, num - 1)
    child = _child(parent, "c", num, [7])
    manager.fork(parent, child)
    for g in (0, 1):
        assert manager.page_ids("c", g) == manager.page_ids("p", g)[:-(-num // PS)]
    decode(manager, child, 8)
    manager.take_plans()
    assert manager.page_ids("c", 1)[:3] == [0, 0, 0]


def test_a_request_added_from_another_runs_on_its_kv():
    h = Harness(make_scheduler(budget=64, max_num_seqs=4))
    h.add(make_request("p", 10, max_tokens=6))
    h.step()
    h.step()  # p: 10 prompt tokens and 1 output computed, its 2nd output not yet
    sched, parent = h.sched, h.sched.requests["p"]
    assert parent.num_computed_tokens == 11
    child = make_request("c", parent.all_token_ids[:9] + [77, 78], max_tokens=4)
    sched.add_request(child, kv_from=parent)
    h.seen["c"] = child
    assert child.status == RequestStatus.RUNNING and sched.running[-1] is child
    assert child.num_computed_tokens == child.num_cached_tokens == 9
    assert h.kv.page_ids("c") == h.kv.page_ids("p")[:3]
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"p": 1, "c": 2}  # only what it does not share
    h.run()  # every step reads each request's own prefix back (the harness checks)
    assert h.kv.stats().num_cow_copies >= 1


def test_a_request_added_from_another_waits_when_nothing_can_be_shared():
    h = Harness(make_scheduler(budget=64, max_num_seqs=2))
    sched = h.sched
    h.add(make_request("p", 10), make_request("q", 5))
    h.step()
    parent = sched.requests["p"]
    full = make_request("full", parent.all_token_ids + [5])  # no sequence slot left
    sched.add_request(full, kv_from=parent)
    other = make_request("other", [3] + parent.all_token_ids)  # no token alike
    sched.add_request(other, kv_from=sched.requests["q"])
    gone = make_request("gone", parent.all_token_ids)
    sched.add_request(gone, kv_from=make_request("x", 4))  # not a live request
    for request in (full, other, gone):
        h.seen[request.request_id] = request
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        assert not h.kv.has_request(request.request_id)
    assert [r.request_id for r in sched.waiting] == ["full", "other", "gone"]
    h.run()

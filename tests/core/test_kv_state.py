"""The state group in the KV cache manager and the scheduler: a state slot per request beside
its pages (admission, finish, recompute, swap, forks), prefix caching off, errors."""

from __future__ import annotations

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.core import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.state_slots import StateGroupSpec
from jaxserve.request import Request, RequestStatus
from tests.core.kv_helpers import PS, admit
from tests.core.scheduler_harness import (
    Harness,
    decode_until_preemption,
    make_request,
    make_scheduler,
    scheduled,
)


def make_kv(num_slots: int = 3, num_host_slots: int | None = None, **kwargs) -> KVCacheManager:
    kwargs.setdefault("watermark", 0.0)
    return KVCacheManager(17, PS, state_group=StateGroupSpec(num_slots, 64, num_host_slots),
                          **kwargs)


# ---------------------------------------------------------------------- manager
def test_without_a_state_group_nothing_changes():
    kv = KVCacheManager(17, PS, watermark=0.0)
    request = Request("a", list(range(6)))
    admit(kv, request)
    assert kv.state_slots is None and kv.state_slot("a") == 0
    assert kv.prefix_caching_disabled_reason is None and kv.pool.prefix_cache is not None
    assert kv.take_plans().state.is_empty()


def test_admission_takes_a_slot_and_a_request_without_one_waits_whole():
    kv = make_kv(num_slots=2)  # one usable slot
    a, b = Request("a", list(range(6))), Request("b", list(range(10, 16)))
    assert admit(kv, a)[1] is not None and kv.state_slot("a") == 1
    num_used = kv.pool.num_used_pages
    assert kv.allocate_slots(b, 6) is None  # pages would fit; no slot: nothing taken
    assert not kv.has_request("b") and kv.pool.num_used_pages == num_used
    assert not kv.state_slots.holds("b")
    kv.free(a)
    assert admit(kv, b)[1] is not None and kv.state_slot("b") == 1
    assert kv.take_plans().state.is_empty()  # a new request's state starts from zero
    with pytest.raises(ValueError, match="'a' holds no state slot"):
        kv.state_slot("a")


def test_free_twice_is_an_error_naming_the_request():
    kv = make_kv()
    a = Request("a", list(range(6)))
    admit(kv, a)
    kv.free(a)
    with pytest.raises(ValueError, match="'a'"):
        kv.free(a)
    assert kv.state_slots.num_free_slots == 2


def test_recompute_restarts_the_state_in_a_fresh_slot():
    kv = make_kv()
    a = Request("a", list(range(6)))
    admit(kv, a)
    kv.free(a)  # preempted for recompute
    a.num_computed_tokens = 0
    admit(kv, a)
    assert kv.state_slots.holds("a") and kv.take_plans().state.is_empty()


def test_prefix_caching_is_off_with_a_reason_and_never_hits():
    kv = make_kv()
    assert kv.pool.prefix_cache is None
    assert "linear-attention state" in kv.prefix_caching_disabled_reason
    a, b = Request("a", list(range(9))), Request("b", list(range(9)))
    admit(kv, a)
    kv.take_plans()
    assert kv.get_computed_pages(b) == ([], 0)
    assert make_kv(enable_prefix_caching=False).prefix_caching_disabled_reason is None


def test_host_state_slots_default_to_one_per_device_slot_when_swapping():
    swapping = make_kv(num_slots=5, swap_space=1.0, bytes_per_page=2**20)
    assert swapping.state_slots.num_host_slots == 4
    assert make_kv(num_slots=5).state_slots.num_host_slots == 0
    assert make_kv(num_slots=5, num_host_slots=1).state_slots.num_host_slots == 1


def test_swap_moves_the_state_with_the_pages():
    kv = make_kv(num_slots=3, swap_space=1.0, bytes_per_page=2**20)
    a = Request("a", list(range(6)))
    admit(kv, a)
    slot = kv.state_slot("a")
    assert kv.swap_out(a) is not None
    (swapped,) = kv.take_plans().state.swap_out.pairs
    assert swapped[0] == slot and kv.state_slots.host_slot_of == {"a": swapped[1]}
    kv.allocate_slots(Request("b", [1, 2]), 2)  # takes the freed slot
    assert kv.swap_in(a) is not None
    assert kv.take_plans().state.swap_in.pairs == [(swapped[1], kv.state_slot("a"))]
    assert kv.state_slot("a") != slot


def test_swap_out_without_a_host_state_slot_falls_back_and_changes_nothing():
    kv = make_kv(num_slots=3, num_host_slots=0, swap_space=1.0, bytes_per_page=2**20)
    a = Request("a", list(range(6)))
    admit(kv, a)
    assert not kv.can_swap_out(a) and kv.swap_out(a) is None
    assert kv.counters.num_swap_fallbacks == 1 and not kv.is_swapped("a")
    assert kv.host_pool.num_free_slots == kv.host_pool.num_slots


def test_swap_in_without_a_free_slot_waits():
    kv = make_kv(num_slots=2, swap_space=1.0, bytes_per_page=2**20)
    a, b = Request("a", list(range(6))), Request("b", [1, 2])
    admit(kv, a)
    kv.swap_out(a)
    admit(kv, b)
    assert not kv.can_swap_in(a) and kv.swap_in(a) is None and kv.is_swapped("a")


def test_fork_copies_the_state_and_needs_every_computed_token_and_a_slot():
    kv = make_kv(num_slots=3)
    parent = Request("p", list(range(6)))
    admit(kv, parent)
    parent.append_output_token_ids(7)
    child = parent.fork("c")
    assert kv.can_fork(parent, 6)
    kv.fork(parent, child)
    assert kv.take_plans().state.copy.pairs == [(kv.state_slot("p"), kv.state_slot("c"))]
    late = Request("late", list(range(6)) + [9])
    late.num_computed_tokens = 4  # a prefix of the parent's: its state went past it
    assert not kv.can_fork(parent, 4)
    with pytest.raises(ValueError, match="parent's state holds all its 6"):
        kv.fork(parent, late)
    third = parent.fork("third")  # no slot left
    assert not kv.can_fork(parent, 6)
    with pytest.raises(ValueError, match="no free state slot"):
        kv.fork(parent, third)
    assert not kv.has_request("third") and not kv.has_request("late")


# -------------------------------------------------------------------- scheduler
def test_scheduler_needs_a_slot_per_sequence():
    kv = KVCacheManager(17, PS, state_group=StateGroupSpec(4, 64))
    with pytest.raises(ValueError, match=r"4 slots \(num_slots.*max_num_seqs=4 needs 5"):
        Scheduler(SchedulerConfig(max_num_seqs=4), kv, 64, 32)
    Scheduler(SchedulerConfig(max_num_seqs=3), kv, 64, 32)


def test_entries_carry_each_requests_own_slot_and_fan_out_copies_it():
    h = Harness(make_scheduler(budget=64, max_num_seqs=4, state=True))
    h.add(make_request("a", 6, max_tokens=3), make_request("p", 5, max_tokens=3, n=2, arrival=1))
    out, _ = h.step()
    slots = {e.request_id: e.state_slot for e in out.scheduled}
    assert sorted(slots.values()) == [1, 2]
    out, _ = h.step()  # "p#1" forked from "p" after the prompt: a copy of p's state
    assert out.plans.state.copy.pairs == [(slots["p"], h.kv.state_slot("p#1"))]
    assert {e.request_id: e.state_slot for e in out.scheduled}["p#1"] == 3
    h.run()  # the fake runner checks each step reads its own state


def test_swap_preemption_moves_the_state_out_and_back():
    h = Harness(make_scheduler(num_pages=9, budget=64, host_slots=6, preemption_mode="swap",
                               max_num_seqs=3, state=True))
    h.add(*(make_request(x, 8, max_tokens=12, arrival=i) for i, x in enumerate("abc")))
    out = decode_until_preemption(h)
    assert out.preempted_request_ids == ["c"] and out.plans.state.swap_out.pairs
    while h.sched.requests["c"].status != RequestStatus.RUNNING:
        out, _ = h.step()
    assert out.plans.state.swap_in.pairs
    assert {e.request_id: e.start_pos for e in out.scheduled}["c"] == 8  # no recompute
    h.run()


def test_a_request_started_from_another_shares_only_the_whole_state():
    h = Harness(make_scheduler(budget=64, max_num_seqs=4, state=True))
    h.add(make_request("p", [5, 6, 7, 8, 9, 10], max_tokens=8))
    h.step()
    h.step()
    parent = h.sched.requests["p"]
    whole = make_request("whole", parent.all_token_ids + [3], max_tokens=2)
    part = make_request("part", parent.all_token_ids[:4] + [3], max_tokens=2)
    for request in (whole, part):
        h.sched.add_request(request, kv_from=parent)
        h.seen[request.request_id] = request
    assert whole.status == RequestStatus.RUNNING and whole.num_computed_tokens == 7
    assert part.status == RequestStatus.WAITING and part.num_computed_tokens == 0
    out, _ = h.step()
    assert (h.kv.state_slot("p"), h.kv.state_slot("whole")) in out.plans.state.copy.pairs
    assert {e.request_id: e.start_pos for e in out.scheduled}["part"] == 0
    h.run()


def test_without_backup_slots_proposals_are_not_verified():
    h = Harness(make_scheduler(budget=64, state=True), propose=lambda r: [20, 21],
                accept=lambda r, p: len(p))
    h.add(make_request("a", 5, max_tokens=6))
    h.run()
    assert all(e.num_spec_tokens == 0 for o in h.outputs for e in o.scheduled)
    assert scheduled(h.outputs[1]) == {"a": 1}

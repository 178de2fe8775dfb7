"""Scheduler tests over the real KVCacheManager with a fake runner (no JAX, no model).

Most tests step the scheduler through `Harness` (tests/core/scheduler_harness.py), which
executes each step's KV plans on simulated pages and checks the scheduler's contract.
"""

from __future__ import annotations

import pytest

from jaxserve.request import RequestStatus
from tests.core.scheduler_harness import (
    EOS,
    Harness,
    decode_until_preemption,
    make_request,
    make_scheduler,
    scheduled,
)


# ------------------------------------------------------------------- budget and order
def test_budget_and_sequence_limits_hold_every_step():
    h = Harness(make_scheduler(budget=16, max_num_seqs=4, num_pages=65))
    h.add(*(make_request(f"r{i}", 3 + 5 * i, max_tokens=4 + i, arrival=i) for i in range(8)))
    h.run()
    totals = [o.total_num_scheduled_tokens for o in h.outputs]
    assert max(totals) == 16 and all(t <= 16 for t in totals)
    assert max(len(o.scheduled) for o in h.outputs) == 4


def test_running_first_then_swapped_then_waiting():
    # 8 usable pages; "b" is swapped out when "a" and "b" both need a fifth page.
    h = Harness(make_scheduler(num_pages=9, budget=64, host_slots=8, preemption_mode="swap"))
    h.add(make_request("a", 12, max_tokens=10, arrival=0),
          make_request("b", 12, max_tokens=20, arrival=1))
    h.step()
    h.add(make_request("c", 3, max_tokens=20, arrival=2))
    assert decode_until_preemption(h).preempted_request_ids == ["b"]
    num_waits = 0
    while "b" not in scheduled(out := h.step()[0]):
        # "c" would fit, but it never jumps ahead of the swapped "b".
        assert scheduled(out) == {"a": 1} and h.kv.pool.num_allocatable_pages >= 1
        num_waits += 1
    assert num_waits >= 2
    assert list(scheduled(out)) == ["b", "c"]  # "a" finished: b resumes, then c joins
    h.run()


def test_running_requests_take_the_budget_before_new_ones():
    h = Harness(make_scheduler(budget=6))
    h.add(*(make_request(f"d{i}", 2, max_tokens=10, arrival=i) for i in range(3)))
    h.step()  # three 2-token prompts
    h.add(make_request("new", 20, arrival=9))
    out, _ = h.step()
    assert scheduled(out) == {"d0": 1, "d1": 1, "d2": 1, "new": 3}


# ----------------------------------------------------------------- chunked prefill
def test_chunked_prefill_shares_steps_with_decodes():
    h = Harness(make_scheduler(budget=16))
    h.add(make_request("a", 3, max_tokens=20), make_request("b", 5, max_tokens=20, arrival=1))
    h.step()
    h.add(make_request("long", 40, arrival=2))
    chunks = []
    while h.sched.requests["long"].num_output_tokens == 0:
        out, _ = h.step()
        assert scheduled(out)["a"] == 1 and scheduled(out)["b"] == 1  # decodes never starve
        chunks.append(scheduled(out)["long"])
        num_samples = {e.request_id: e.num_samples for e in out.scheduled}["long"]
        assert num_samples == (1 if sum(chunks) == 40 else 0)
    assert chunks == [14, 14, 12]


def test_long_prefill_token_threshold_caps_each_chunk():
    h = Harness(make_scheduler(budget=64, long_prefill_token_threshold=8))
    h.add(make_request("x", 30, max_tokens=2), make_request("y", 5, max_tokens=2, arrival=1))
    out, _ = h.step()
    assert scheduled(out) == {"x": 8, "y": 5}
    sizes = [scheduled(h.step()[0]).get("x") for _ in range(3)]
    assert sizes == [8, 8, 6]


@pytest.mark.parametrize("config", [{"enable_chunked_prefill": False},
                                    {"scheduling_mode": "continuous"}])
def test_without_chunking_a_prompt_that_does_not_fit_waits(config):
    h = Harness(make_scheduler(budget=32, **config))
    h.add(make_request("a", 4, max_tokens=10))
    h.step()
    h.add(make_request("b", 20, arrival=1), make_request("c", 20, arrival=2),
          make_request("d", 2, arrival=3))
    out, _ = h.step()
    assert scheduled(out) == {"a": 1, "b": 20}  # c (and d behind it) wait
    out, _ = h.step()
    assert scheduled(out) == {"a": 1, "b": 1, "c": 20, "d": 2}
    h.run()
    assert all(o.total_num_scheduled_tokens <= 32 for o in h.outputs)


# -------------------------------------------------------------------- prefix cache
def test_prefix_hits_count_as_computed():
    system = list(range(100, 148))  # three 16-token pages
    h = Harness(make_scheduler(page_size=16, budget=128, max_model_len=128))
    first = make_request("first", system + [7, 8, 9, 10, 11])
    h.add(first)
    h.step()
    second = make_request("second", system + [20, 21], arrival=1)
    exact = make_request("exact", list(system), arrival=2)
    again = make_request("again", system + [7, 8, 9, 10, 11], arrival=3)
    h.add(second, exact, again)
    out, _ = h.step()
    entries = {e.request_id: e for e in out.scheduled}
    assert entries["second"].start_pos == 48 and entries["second"].num_new_tokens == 2
    assert second.num_cached_tokens == 48
    # The hit stops before the page of the last prompt token: its logits are needed.
    assert entries["exact"].start_pos == 32 and entries["exact"].num_new_tokens == 16
    assert entries["again"].start_pos == 48 and entries["again"].num_new_tokens == 5
    first_pages = h.kv.page_ids("first")[:3]
    assert h.kv.page_ids("second")[:3] == first_pages
    assert [h.kv.pool.pages[p].ref_cnt for p in first_pages] == [4, 4, 3]
    assert h.kv.stats().prefix_hits == 48 + 32 + 48
    h.run()


# ---------------------------------------------------------------------- preemption
def test_fcfs_preempts_the_most_recently_admitted_and_recomputes():
    # 8 usable pages, three 8-token prompts (2 pages each): the third page of each
    # request runs the pool dry.
    h = Harness(make_scheduler(num_pages=9, budget=64, prefix=False))
    h.add(make_request("a", 8, max_tokens=12, arrival=0))
    h.step()
    h.add(make_request("b", 8, max_tokens=12, arrival=1))
    h.step()
    h.add(make_request("c", 8, max_tokens=12, arrival=2),
          make_request("late", 3, max_tokens=2, arrival=3))
    out = decode_until_preemption(h)
    assert out.preempted_request_ids == ["c"]
    c = h.sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert h.sched.waiting[0] is c and h.sched.num_preemptions == c.num_preemptions == 1
    assert not h.kv.has_request("c")
    tokens_before = list(c.all_token_ids)
    while "c" not in scheduled(out):
        out, _ = h.step()
    entry = {e.request_id: e for e in out.scheduled}["c"]
    # Recompute: the prompt plus every generated token, then one new sample.
    assert entry.start_pos == 0 and entry.token_ids == tokens_before
    assert entry.num_samples == 1 and entry.sampling_counter == len(tokens_before) - 8
    h.run()
    assert c.output_token_ids == list(range(10, 22))  # nothing lost or repeated


def test_priority_preempts_the_largest_priority_then_arrival():
    h = Harness(make_scheduler(num_pages=9, budget=64, prefix=False,
                               scheduling_policy="priority"))
    h.add(make_request("urgent", 8, max_tokens=12, priority=0, arrival=2),
          make_request("lazy_old", 8, max_tokens=12, priority=5, arrival=0),
          make_request("lazy_new", 8, max_tokens=12, priority=5, arrival=1))
    out, _ = h.step()
    assert list(scheduled(out)) == ["urgent", "lazy_old", "lazy_new"]  # by priority
    out = decode_until_preemption(h)
    assert out.preempted_request_ids == ["lazy_new"]
    h.add(make_request("mid", 3, max_tokens=12, priority=1, arrival=3))
    assert [r.request_id for r in h.sched.waiting] == ["mid", "lazy_new"]  # by priority too
    h.run()


def test_preempting_an_already_scheduled_request_returns_its_budget():
    h = Harness(make_scheduler(num_pages=10, budget=16, prefix=False,
                               scheduling_policy="priority"))
    h.add(make_request("old", 8, max_tokens=12, priority=5, arrival=0),
          make_request("new", 8, max_tokens=12, priority=5, arrival=1))
    h.step()
    h.add(make_request("urgent", 8, max_tokens=12, priority=0, arrival=2),
          make_request("x", 3, max_tokens=12, priority=1, arrival=3))
    h.step()
    assert [r.request_id for r in h.sched.running] == ["old", "new", "urgent", "x"]
    h.sched.max_num_batched_tokens = 3  # one token short of four decodes
    out, _ = h.step()
    # "new" was scheduled before "urgent" ran out of pages; its token goes to "x".
    assert out.preempted_request_ids == ["new"]
    assert scheduled(out) == {"old": 1, "urgent": 1, "x": 1}
    h.run()


def test_priority_ties_preempt_the_most_recently_admitted_sibling():
    h = Harness(make_scheduler(num_pages=9, scheduling_policy="priority"))
    h.add(make_request("p", 6, n=3, max_tokens=20, ignore_eos=True))
    out = decode_until_preemption(h)
    assert out.preempted_request_ids[0] == "p#2"
    h.run()


def test_swap_preemption_moves_pages_to_host_and_back():
    h = Harness(make_scheduler(num_pages=9, budget=64, host_slots=6, prefix=False,
                               preemption_mode="swap"))
    h.add(make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12, arrival=1),
          make_request("c", 8, max_tokens=12, arrival=2))
    out = decode_until_preemption(h)
    c = h.sched.requests["c"]
    assert out.preempted_request_ids == ["c"] and c.status == RequestStatus.SWAPPED
    assert list(h.sched.swapped) == [c] and c.num_computed_tokens == 8
    assert len(out.plans.swap_out) == 2 and h.kv.host_pool.num_free_slots == 4
    swap_slots = [slot for _, slot in out.plans.swap_out.pairs]
    while c.status != RequestStatus.RUNNING:
        out, _ = h.step()
    assert sorted(slot for slot, _ in out.plans.swap_in.pairs) == sorted(swap_slots)
    entry = {e.request_id: e for e in out.scheduled}["c"]
    assert entry.start_pos == 8 and entry.num_new_tokens == 1  # no recompute
    h.run()  # the fake runner checked the swapped KV came back intact
    assert h.kv.stats().num_swap_ins == h.kv.stats().num_swap_outs >= 1


def test_swap_without_host_space_falls_back_to_recompute():
    h = Harness(make_scheduler(num_pages=9, budget=64, host_slots=0, preemption_mode="swap"))
    h.add(*(make_request(x, 8, max_tokens=12, arrival=i) for i, x in enumerate("abc")))
    out = decode_until_preemption(h)
    c = h.sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and h.sched.waiting[0] is c
    assert not h.sched.swapped and not out.plans.swap_out.pairs
    assert h.kv.stats().num_swap_fallbacks == 1
    h.run()


# ----------------------------------------------------------------- add and finish
def test_add_request_rejects_what_can_never_run():
    sched = make_scheduler(num_pages=5, max_model_len=64)  # 4 usable pages of 4 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 65))
    with pytest.raises(ValueError, match="needs KV for 20 tokens; one request may hold at most 16"):
        sched.add_request(make_request("big", 20, max_tokens=1))
    sched.add_request(make_request("ok", 10))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 3))
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=2).add_request(make_request("wide", 3, n=3))
    assert list(sched.requests) == ["ok"]


def test_request_outgrowing_the_pool_ends_length_capped():
    # 8 usable pages hold 32 tokens of KV; the 33rd token is sampled, never computed.
    h = Harness(make_scheduler(num_pages=9, max_model_len=128))
    assert h.sched.max_kv_tokens == 32
    grows = make_request("grows", 10, max_tokens=100, ignore_eos=True)
    other = make_request("other", 6, max_tokens=30, ignore_eos=True, arrival=1)
    h.add(grows, other)
    h.run()
    assert grows.status == other.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert grows.num_tokens == other.num_tokens == 33 and h.sched.num_preemptions > 0


@pytest.mark.parametrize("kwargs, max_kv_tokens, match", [
    ({"watermark": 0.25}, 24, "admission watermark"),  # two of 8 pages kept free at admission
    ({"budget": 16, "enable_chunked_prefill": False}, 16, "max_num_batched_tokens"),
])
def test_watermark_and_unchunked_budget_bound_a_request(kwargs, max_kv_tokens, match):
    h = Harness(make_scheduler(num_pages=9, max_model_len=128, **kwargs))
    assert h.sched.max_kv_tokens == max_kv_tokens
    with pytest.raises(ValueError, match=match):
        h.add(make_request("big", max_kv_tokens + 1))
    edge = make_request("edge", max_kv_tokens)
    grows = make_request("grows", 5, max_tokens=100, ignore_eos=True, arrival=1)
    h.add(edge, grows)
    h.run()
    assert edge.num_output_tokens == 1 and grows.num_tokens == max_kv_tokens + 1


def test_finish_and_abort_free_pages_everywhere():
    h = Harness(make_scheduler(num_pages=9, budget=64, host_slots=8, preemption_mode="swap"))
    h.add(*(make_request(x, 8, max_tokens=20, arrival=i) for i, x in enumerate("abc")))
    decode_until_preemption(h)
    h.add(make_request("waiting", 5, arrival=5))
    assert [r.request_id for r in h.sched.swapped] == ["c"]
    free_before = h.kv.pool.num_allocatable_pages
    b = h.sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and b.is_finished()
    assert h.kv.pool.num_allocatable_pages == free_before + 3
    for rid in ("c", "waiting", "a"):
        assert h.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED) is not None
    assert h.sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    assert h.sched.finish_request("unknown", RequestStatus.FINISHED_ABORTED) is None
    h.check_drained()
    assert h.sched.schedule().is_empty


def test_abort_between_schedule_and_update_is_ignored():
    h = Harness(make_scheduler())
    h.add(make_request("a", 5), make_request("b", 5, arrival=1))
    out = h.sched.schedule()
    h._run(out)
    h.sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    results = h.sched.update_from_output(out, {"a": [11], "b": [12]})
    assert [(r.request_id, t) for r, t in results] == [("b", [12])]
    h.run()


def test_an_id_reused_before_update_is_a_new_request_the_late_update_leaves_alone():
    """Aborted while its step is in flight, then re-added under the same id (async
    scheduling): the step's update and `unschedule` must not touch the new request."""
    h = Harness(make_scheduler())
    h.add(make_request("a", 5), make_request("b", 5, arrival=1))
    out = h.sched.schedule()
    h._run(out)
    h.sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    h.add(make_request("a", 7, arrival=2))
    fresh = h.sched.requests["a"]
    assert h.sched.scheduled_request(out, "a") is None
    assert h.sched.scheduled_request(out, "b") is h.sched.requests["b"]
    h.sched.unschedule(out)  # as a failed dispatch would: "a" is not this step's "a"
    assert (fresh.num_computed_tokens, fresh.num_output_placeholders) == (0, 0)
    h.sched.requests["b"].num_computed_tokens += 5  # undo the unschedule for "b"
    h.sched.requests["b"].num_output_placeholders += 1
    results = h.sched.update_from_output(out, {"a": [11], "b": [12]})
    assert [(r.request_id, t) for r, t in results] == [("b", [12])]
    assert fresh.output_token_ids == [] and fresh.num_output_placeholders == 0
    h.run()
    assert len(fresh.output_token_ids) > 0


# ------------------------------------------------------------------------ fan-out
def test_fan_out_forks_sharing_prompt_pages_then_copies_on_write():
    h = Harness(make_scheduler(budget=4, max_num_seqs=4))
    parent = make_request("p", 10, n=3, max_tokens=5)
    h.add(parent)
    samples = [e.num_samples for _ in range(3) for e in h.step()[0].scheduled]
    assert samples == [0, 0, 3]  # only the last prompt chunk samples, three rows
    ids = [r.request_id for r in h.sched.running]
    assert ids == ["p", "p#1", "p#2"]
    kids = [h.sched.requests[i] for i in ids]
    assert [k.sample_index for k in kids] == [0, 1, 2]
    assert [k.forked_from for k in kids] == [None, "p", "p"]
    assert [k.output_token_ids for k in kids] == [[10], [110], [210]]
    tables = [h.kv.page_ids(i) for i in ids]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert [h.kv.pool.pages[p].ref_cnt for p in tables[0]] == [3, 3, 3]
    # Each child writes position 10 into the shared, partly filled third page.
    out, _ = h.step()
    assert len(out.plans.copy) == 2 and {s for s, _ in out.plans.copy.pairs} == {tables[0][2]}
    new_tables = [h.kv.page_ids(i) for i in ids]
    assert all(t[:2] == tables[0][:2] for t in new_tables)
    assert len({t[2] for t in new_tables}) == 3
    assert [h.kv.pool.pages[p].ref_cnt for p in tables[0][:2]] == [3, 3]
    h.run()
    assert [k.output_token_ids for k in kids] == [[10 + 100 * i + j for j in range(5)]
                                                  for i in range(3)]


def test_fan_out_holds_one_sequence_slot_per_sample():
    h = Harness(make_scheduler(max_num_seqs=4))
    h.add(make_request("p", 6, n=3), make_request("x", 3, arrival=1),
          make_request("y", 3, arrival=2))
    out, _ = h.step()
    assert list(scheduled(out)) == ["p", "x"] and out.num_rows == 4
    out, _ = h.step()
    assert "y" not in scheduled(out) and len(h.sched.running) == 4
    h.run()


# -------------------------------------------------------------------------- stops
@pytest.mark.parametrize("params, tokens, status, reason, num_out", [
    ({}, [11, EOS, 12], RequestStatus.FINISHED_STOPPED, None, 2),
    ({"ignore_eos": True, "max_tokens": 3}, [11, EOS, 12], RequestStatus.FINISHED_LENGTH_CAPPED,
     None, 3),
    ({"stop_token_ids": [42]}, [11, 42, 12], RequestStatus.FINISHED_STOPPED, 42, 2),
    ({"min_tokens": 2}, [EOS, EOS, EOS, 13], RequestStatus.FINISHED_STOPPED, None, 3),
    ({"max_tokens": 2}, [11, 12, 13], RequestStatus.FINISHED_LENGTH_CAPPED, None, 2),
    ({"max_tokens": None}, [11] * 20, RequestStatus.FINISHED_LENGTH_CAPPED, None, 6),
])
def test_stop_conditions(params, tokens, status, reason, num_out):
    h = Harness(make_scheduler(max_model_len=16))
    request = make_request("r", 10, **{"max_tokens": 8, **params})
    h.add(request)
    for token in tokens:
        out = h.sched.schedule()
        h._run(out)
        h.sched.update_from_output(out, {"r": [token]})
        if request.is_finished():
            break
    assert request.status == status and request.stop_reason == reason
    assert request.num_output_tokens == num_out
    h.check_drained()


# -------------------------------------------------------------------------- modes
def test_continuous_mode_never_chunks():
    h = Harness(make_scheduler(budget=24, scheduling_mode="continuous"))
    h.add(*(make_request(f"r{i}", 6 + 4 * i, max_tokens=4, arrival=i) for i in range(5)))
    h.run()  # _check_output asserts every entry runs to the request's end
    assert [sorted(scheduled(o)) for o in h.outputs][0] == ["r0", "r1"]


# --------------------------------------------------------- the scheduler's own mutators
def test_fork_shares_pages_and_runs_the_child():
    """`Scheduler.fork` (used by fan-out): the child holds the parent's
    tokens and pages and runs next; an id in use is refused and changes nothing."""
    h = Harness(make_scheduler(budget=64))
    h.add(make_request("p", 10, max_tokens=4))
    h.step()
    sched = h.sched
    parent = sched.requests["p"]
    pages = h.kv.page_ids("p")
    child = sched.fork(parent, "p.1")
    assert sched.requests["p.1"] is child and sched.running[-1] is child
    assert child.all_token_ids == parent.all_token_ids
    assert h.kv.page_ids("p.1") == h.kv.page_ids("p")
    with pytest.raises(ValueError, match="'p.1' is already in use"):
        sched.fork(parent, "p.1")
    assert [r.request_id for r in sched.running] == ["p", "p.1"]
    sched.finish_request("p.1", RequestStatus.FINISHED_ABORTED)  # the parent's pages stay
    assert h.kv.page_ids("p") == pages
    h.run()


def test_set_proposals_reaches_known_requests_only():
    h = Harness(make_scheduler(budget=64))
    h.add(make_request("a", 5, max_tokens=8))
    h.step()
    h.sched.set_proposals({"a": [7, 8], "gone": [1]})
    assert h.sched.requests["a"].spec_token_ids == [7, 8]
    assert "gone" not in h.sched.requests

"""What the scheduler sends of block tables: whole once, then only what changed; released ids.

The harness (tests/core/scheduler_harness.py) rebuilds every step's tables from these deltas
as the runner does and checks them against the KV manager's after every step; these tests
check that the deltas are small where they should be.
"""

from __future__ import annotations

from jaxserve.request import RequestStatus
from tests.core.scheduler_harness import (
    PS,
    Harness,
    decode_until_preemption,
    make_request,
    make_scheduler,
)


def _entries(out):
    return {e.request_id: e for e in out.scheduled}


def test_decodes_send_a_page_only_when_they_cross_into_one():
    h = Harness(make_scheduler())
    h.add(make_request("a", 5, max_tokens=8))
    first = _entries(h.step()[0])["a"]
    assert (first.pages_from, first.num_pages) == (0, 2)  # the whole table, once
    sent = []
    for _ in range(6):  # positions 5..10: a page appended at 8
        e = _entries(h.step()[0])["a"]
        sent.append((e.start_pos, e.pages_from, len(e.page_ids)))
    assert sent == [(5, 2, 0), (6, 2, 0), (7, 2, 0), (8, 2, 1), (9, 3, 0), (10, 3, 0)]
    h.run()


def test_fan_out_children_start_whole_and_copy_on_write_resends_from_that_page():
    h = Harness(make_scheduler(budget=16, max_num_seqs=4))
    h.add(make_request("p", 10, n=3, max_tokens=5))
    h.step()
    out, _ = h.step()  # each sample writes position 10 into the shared third page
    got = {rid: (e.pages_from, len(e.page_ids)) for rid, e in _entries(out).items()}
    # the parent sent pages 0-2 with its prompt and now its private copy of the third;
    # the children send their whole tables (the last holder keeps the shared page)
    assert got == {"p": (2, 1), "p#1": (0, 3), "p#2": (0, 3)}
    assert len(out.plans.copy) == 2
    h.run()


def test_swap_out_releases_the_table_and_swap_in_sends_it_whole():
    h = Harness(make_scheduler(num_pages=9, budget=64, host_slots=6, prefix=False,
                               preemption_mode="swap"))
    h.add(*(make_request(x, 8, max_tokens=12, arrival=i) for i, x in enumerate("abc")))
    out = decode_until_preemption(h)
    assert out.preempted_request_ids == ["c"] and "c" in out.released_request_ids
    c = h.sched.requests["c"]
    while c.status != RequestStatus.RUNNING:
        out, _ = h.step()
    e = _entries(out)["c"]
    assert e.pages_from == 0 and e.num_pages * PS >= e.start_pos + 1
    h.run()


def test_a_finished_request_is_released_with_the_next_step():
    h = Harness(make_scheduler())
    h.add(make_request("a", 3, max_tokens=1), make_request("b", 3, max_tokens=4, arrival=1))
    out, _ = h.step()  # both prompts; "a" ends on its first token
    assert out.released_request_ids == [] and h.sched.requests.get("a") is None
    out, _ = h.step()
    assert out.released_request_ids == ["a"] and "a" not in _entries(out)
    h.run()


def test_an_unscheduled_step_resends_whole_tables():
    h = Harness(make_scheduler())
    h.add(make_request("a", 5, max_tokens=8))
    h.step()
    out = h.sched.schedule()  # its dispatch "fails": the runner may hold part of it
    assert _entries(out)["a"].pages_from == 2
    h.sched.unschedule(out)
    h.rows.release(["a"])  # as if the runner had dropped the row
    again, _ = h.step()
    e = _entries(again)["a"]
    assert (e.pages_from, e.start_pos) == (0, 5)
    h.run()

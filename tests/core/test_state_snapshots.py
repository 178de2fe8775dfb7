"""Prefix caching with a state group: snapshots of request states at page boundaries (LRU,
the longest one under the page hit, a hit in the pass after the snapshot's step, eviction
while a hit reads the slot, reset, a step that never ran) and the scheduler's aligned chunks.

A simulated state pool holds per slot the fingerprint of the last token its state took in;
the plans run as the runner runs them (a copy gathers every source before it scatters).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core import KVCacheManager
from jaxserve.core.state_slots import StateGroupSpec
from jaxserve.core.state_snapshots import StateSnapshots
from jaxserve.request import Request
from tests.core.kv_helpers import PS
from tests.core.test_kv_properties import fingerprint

NUM_SLOTS, NUM_SNAPSHOTS = 4, 2  # rows 1-3 for requests, 4-5 for snapshots
PROMPT = [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13]  # three full pages and one token


class Pool:
    """A KV manager with a state group and its simulated state rows."""

    def __init__(self, num_snapshots: int = NUM_SNAPSHOTS):
        spec = StateGroupSpec(NUM_SLOTS, 64, num_snapshot_slots=num_snapshots)
        self.kv = KVCacheManager(20, PS, watermark=0.0, state_group=spec)
        self.state = np.full(spec.num_rows, -1, dtype=np.int64)
        self.scheduled: dict[str, tuple[Request, int]] = {}

    def schedule(self, request: Request, num_new: int | None = None) -> int:
        """Allocates the request's next chunk (a new one looks its prefix up); returns the
        tokens its hit covers."""
        hit_ids, num_hit = [], 0
        if not self.kv.has_request(request.request_id):
            hit_ids, num_hit = self.kv.get_computed_pages(request)
        num_new = num_new or request.num_tokens - request.num_computed_tokens - num_hit
        assert self.kv.allocate_slots(request, num_new, num_hit, hit_ids) is not None
        request.num_computed_tokens += num_hit
        self.scheduled[request.request_id] = (request, num_new)
        return num_hit

    def step(self):
        """Takes the plans, runs the state moves, then every scheduled step's state read
        (checked) and write."""
        plans = self.kv.take_plans().state
        copy = plans.copy.as_array()
        assert len(set(copy[:, 1])) == len(copy)
        self.state[copy[:, 1]] = self.state[copy[:, 0]]  # NOTE: numpy gathers, then scatters
        for rid, (request, num_new) in self.scheduled.items():
            slot, start = self.kv.state_slot(rid), request.num_computed_tokens
            want = fingerprint(request.all_token_ids, start - 1) if start else -1
            assert not start or self.state[slot] == want, f"{rid} reads a wrong state"
            self.state[slot] = fingerprint(request.all_token_ids, start + num_new - 1)
            request.num_computed_tokens += num_new
        self.scheduled.clear()
        return plans


def test_a_hit_resumes_the_longest_snapshot_under_the_page_hit():
    pool = Pool()
    a = Request("a", PROMPT)
    pool.schedule(a, 4)
    pool.step()
    pool.schedule(a, 5)  # ends off a boundary: no snapshot at 8
    pool.step()
    pool.schedule(a, 4)
    pool.step()
    pool.step()  # the snapshot at 4 is copied now
    assert len(pool.kv.snapshots) == 1 and pool.kv.snapshots.held_slots() == [NUM_SLOTS]
    b = Request("b", PROMPT[:12] + [99, 98])
    assert pool.kv.get_computed_pages(b)[1] == 4  # the pages hit 12; the snapshot is at 4
    assert pool.schedule(b) == 4
    plans = pool.step()
    assert plans.copy.pairs == [(NUM_SLOTS, pool.kv.state_slot("b"))]
    assert pool.kv.counters.prefix_hits == 4


def test_a_hit_in_the_pass_after_the_snapshot_step_reads_the_request_slot():
    """The chain in one pass: the snapshot of a's step is copied with the plans that also
    start b from it, and a gave its slot back meanwhile (b gets that very slot)."""
    pool = Pool()
    a = Request("a", PROMPT)
    pool.schedule(a, 8)
    pool.step()  # a's state reaches 8; its snapshot is registered, copied next take
    a_slot = pool.kv.state_slot("a")
    pool.kv.free(a)
    b = Request("b", PROMPT[:8] + [50, 51])
    assert pool.schedule(b) == 8
    assert pool.kv.state_slot("b") == a_slot  # the freed slot, handed out again
    c = Request("c", PROMPT[:8] + [60])
    assert pool.schedule(c) == 8  # reads a's slot too, before b's step writes it
    plans = pool.step()
    assert sorted(plans.copy.pairs) == sorted([(a_slot, NUM_SLOTS),
                                               (a_slot, pool.kv.state_slot("c"))])
    d = Request("d", PROMPT[:8] + [70])
    for request in (b, c):
        pool.kv.free(request)
    assert pool.schedule(d) == 8  # now from the snapshot slot
    assert pool.step().copy.pairs == [(NUM_SLOTS, pool.kv.state_slot("d"))]


def test_lru_eviction_and_eviction_while_a_hit_reads_the_slot():
    pool = Pool(num_snapshots=1)
    snaps = pool.kv.snapshots
    a = Request("a", PROMPT)
    pool.schedule(a, 4)
    pool.step()
    pool.step()  # snapshot of a[:4] in the one snapshot slot
    b = Request("b", [20, 21, 22, 23, 24])
    pool.schedule(b, 4)
    pool.step()  # b[:4] registered: the least recently used, a[:4], goes
    assert pool.kv.get_computed_pages(Request("x", PROMPT[:5]))[1] == 0
    pool.step()
    # A hit on b[:4] reads the slot in the same plans that copy a late snapshot into it.
    pool.kv.free(a)  # a slot for c below
    late = Request("late", [30, 31, 32])
    late.num_output_placeholders = 1  # its fourth token is in flight
    pool.kv.allocate_slots(late, 4)
    pool.kv.take_plans()  # registered once its token is known
    late.append_output_token_ids(33)
    late.num_output_placeholders = 0
    c = Request("c", [20, 21, 22, 23, 40])
    hit_ids, num_hit = pool.kv.get_computed_pages(c)
    assert num_hit == 4
    assert pool.kv.allocate_slots(c, 1, num_hit, hit_ids) is not None
    pool.state[NUM_SLOTS] = 111  # the slot's content before the plans run
    pool.state[pool.kv.state_slot("late")] = 222
    pairs = pool.kv.take_plans().state.copy.pairs
    assert sorted(pairs) == sorted([(NUM_SLOTS, pool.kv.state_slot("c")),
                                    (pool.kv.state_slot("late"), NUM_SLOTS)])
    copy = np.asarray(pairs)
    pool.state[copy[:, 1]] = pool.state[copy[:, 0]]
    assert pool.state[pool.kv.state_slot("c")] == 111 and pool.state[NUM_SLOTS] == 222
    assert snaps.longest(late.page_hashes, 1) == 1 and snaps.longest(b.page_hashes, 1) == 0


def test_reset_drops_every_snapshot_and_a_step_that_never_ran_leaves_none():
    pool = Pool()
    a = Request("a", PROMPT)
    pool.schedule(a, 8)
    pool.step()
    pool.step()
    assert len(pool.kv.snapshots) == 1
    pool.kv.free(a)
    pool.kv.evict_cached_pages()  # what reset_prefix_cache and sleep do
    assert len(pool.kv.snapshots) == 0 and pool.kv.snapshots.num_free_slots == NUM_SNAPSHOTS
    assert pool.kv.get_computed_pages(Request("b", PROMPT))[1] == 0
    b = Request("b", PROMPT)
    pool.schedule(b, 8)
    pool.kv.take_plans()
    pool.kv.resend_pages("b")  # its dispatch failed: the step never ran
    assert len(pool.kv.snapshots) == 0
    pool.kv.free(b)
    assert pool.kv.take_plans().state.is_empty()
    # Freed before the pass's take: its step never runs, no snapshot either.
    c = Request("c", PROMPT)
    pool.schedule(c, 4)
    pool.kv.free(c)
    pool.kv.take_plans()
    assert len(pool.kv.snapshots) == 0


def test_zero_snapshot_slots_keep_prefix_caching_off_with_the_reason():
    kv = KVCacheManager(20, PS, state_group=StateGroupSpec(NUM_SLOTS, 64))
    assert kv.snapshots is None and kv.pool.prefix_cache is None
    assert "num_state_snapshots=0" in kv.prefix_caching_disabled_reason
    on = KVCacheManager(20, PS, state_group=StateGroupSpec(NUM_SLOTS, 64, num_snapshot_slots=1))
    assert on.prefix_caching_disabled_reason is None and on.pool.prefix_cache is not None


@pytest.mark.parametrize("start, num_new, num_tokens, want", [
    (0, 13, 13, 12),  # up to the last full page, then the remainder
    (12, 1, 13, 1),
    (0, 7, 13, 4),  # cut back to a boundary
    (0, 3, 13, 3),  # a budget below one page still progresses
    (3, 3, 13, 1),  # and gets back onto the boundaries
    (2, 1, 13, 1),
    (0, 8, 8, 8),  # a prompt of whole pages
    (11, 1, 12, 1),  # a decode onto a boundary
])
def test_chunks_end_on_page_boundaries(start, num_new, num_tokens, want):
    snaps = StateSnapshots(NUM_SLOTS, 1, PS)
    request = Request("r", list(range(num_tokens)))
    request.num_computed_tokens = start
    assert snaps.align_chunk(request, num_new) == want


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="num_snapshot_slots must be >= 0"):
        StateGroupSpec(NUM_SLOTS, 64, num_snapshot_slots=-1)
    with pytest.raises(ValueError, match="num_snapshot_slots must be >= 1"):
        StateSnapshots(NUM_SLOTS, 0, PS)
    pool = Pool()
    a = Request("a", PROMPT)
    pool.schedule(a, 9)  # its pages hold 8 tokens, its state none at a boundary
    pool.step()
    b = Request("b", PROMPT)
    with pytest.raises(ValueError, match="'b' hits 8 tokens, but no state snapshot holds"):
        pool.kv.allocate_slots(b, 5, 8, pool.kv.page_ids("a")[:2])
    assert not pool.kv.has_request("b")  # nothing taken

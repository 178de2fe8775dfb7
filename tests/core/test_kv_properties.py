"""Stateful property test: random scheduling against a simulated device and host memory.

A toy scheduler drives the KVCacheManager through admit / chunked prefill / decode /
fork / free / recompute / swap-out / swap-in / evict / step. Every slot of a fake KV
pool holds a fingerprint of the token prefix it belongs to; each step executes the
emitted plans (swap-out, swap-in, copy, in that order) and the forward's writes, then
checks that every request reads its own prefix back through its block table.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.core import NULL_PAGE_ID, KVCacheManager
from jaxserve.request import Request

PS = 4
NUM_PAGES = 20
NUM_HOST_SLOTS = 10
BYTES_PER_PAGE = 2**26
MAX_TOKENS = 28
TOKENS = st.integers(0, 2)  # a tiny vocabulary
# Shared "system prompts" (two full pages, one and a half pages) so prefixes hit.
PROMPTS = st.builds(lambda system, user: system + user,
                    st.sampled_from([[], [0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 1, 0, 0]]),
                    st.lists(TOKENS, min_size=1, max_size=8))


def fingerprint(token_ids: list[int], position: int) -> int:
    """What the KV of `position` depends on: every token up to it."""
    return hash(tuple(token_ids[:position + 1])) & 0x7FFFFFFF


def hits_of(hit_ids, num_groups: int) -> list[list[int]]:
    """`get_computed_pages`' ids as one list per group."""
    return [list(hit_ids)] if num_groups == 1 else [list(ids) for ids in hit_ids]


class KVCacheMachine(RuleBasedStateMachine):
    WINDOWS: tuple[int, ...] = (0,)  # the KV cache groups' windows

    STATE_GROUP = None  # a StateGroupSpec: the manager keeps state slots too

    def __init__(self):
        super().__init__()
        self.num_pages = (NUM_PAGES - 1) * len(self.WINDOWS) + 1
        self.manager = KVCacheManager(
            self.num_pages, PS, watermark=0.1,
            swap_space=NUM_HOST_SLOTS * BYTES_PER_PAGE / 2**30, bytes_per_page=BYTES_PER_PAGE,
            group_windows=self.WINDOWS, state_group=self.STATE_GROUP)
        self.device = np.full((self.num_pages, PS), -1, dtype=np.int64)
        self.host = np.full((NUM_HOST_SLOTS, PS), -2, dtype=np.int64)
        self.requests: dict[str, Request] = {}  # holding KV: running or swapped
        self.waiting: list[Request] = []
        self.scheduled: dict[str, int] = {}
        self.num_ids = 0

    # ------------------------------------------------------------- helpers
    def new_id(self) -> str:
        self.num_ids += 1
        return f"r{self.num_ids}"

    def running_ids(self, unscheduled: bool = False) -> list[str]:
        return sorted(rid for rid in self.requests if not self.manager.is_swapped(rid)
                      and not (unscheduled and rid in self.scheduled))

    def swapped_ids(self) -> list[str]:
        return sorted(rid for rid in self.requests if self.manager.is_swapped(rid))

    def snapshot(self):
        pool, tables = self.manager.pool, self.manager.tables
        pending, states = tables.pending, tables.requests
        return (sorted((rid, tuple(tuple(p.page_id for p in t) for t in s.tables))
                       for rid, s in states.items() if not s.is_swapped),
                [(p.ref_cnt, p.page_hash) for p in pool.pages],
                [p.page_id for p in pool.free_queue], list(self.manager.host_pool._free_slot_ids),
                sorted(rid for rid, s in states.items() if s.is_swapped),
                dict(pending.copy_src), dict(pending.pins),
                dict(pending.swap_in_src), list(pending.swap_out_pairs), self.state_snapshot())

    # Hooks of a machine with a state group (test_kv_state_properties.py).
    def state_snapshot(self):
        return ()

    def run_state_moves(self, plans) -> None:
        """Executes the step's state plans."""

    def write_state(self, request: Request, num_new: int) -> None:
        """The step's state read and write for a request computing `num_new` tokens."""

    def settle(self, request: Request, num_new: int) -> None:
        """After the step computed `num_new` tokens of `request` (a verify step's outcome)."""

    def schedule(self, request: Request, num_new_tokens: int, hit_ids=(), num_hit: int = 0):
        before = self.snapshot()
        new_ids = self.manager.allocate_slots(request, num_new_tokens, num_hit, list(hit_ids))
        if new_ids is None:
            assert self.snapshot() == before, "a failed allocation changed the manager"
            return False
        assert NULL_PAGE_ID not in new_ids
        for g, ids in enumerate(hits_of(hit_ids, len(self.WINDOWS))):
            assert self.manager.page_ids(request.request_id, g)[:len(ids)] == ids
        request.num_computed_tokens += num_hit
        self.scheduled[request.request_id] = num_new_tokens
        return True

    # --------------------------------------------------------------- rules
    @rule(prompt=PROMPTS, salt=st.sampled_from([None, "t"]))
    def add(self, prompt, salt):
        self.waiting.append(Request(self.new_id(), prompt, cache_salt=salt))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        request = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        hit_ids, num_hit = self.manager.get_computed_pages(request)
        hits = hits_of(hit_ids, len(self.WINDOWS))
        assert num_hit < request.num_tokens and all(num_hit == len(ids) * PS for ids in hits)
        chunk = data.draw(st.integers(1, request.num_tokens - num_hit))
        if self.schedule(request, chunk, hit_ids, num_hit):
            self.waiting.remove(request)
            self.requests[request.request_id] = request

    @precondition(lambda self: self.running_ids(unscheduled=True))
    @rule(data=st.data())
    def continue_request(self, data):
        rid = data.draw(st.sampled_from(self.running_ids(unscheduled=True)))
        request = self.requests[rid]
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining:
            self.schedule(request, data.draw(st.integers(1, remaining)))

    @precondition(lambda self: self.running_ids(unscheduled=True))
    @rule(data=st.data())
    def fork(self, data):
        parent = self.requests[data.draw(st.sampled_from(self.running_ids(unscheduled=True)))]
        self.fork_child(parent)

    def fork_child(self, parent: Request) -> Request | None:
        """Forks `parent` (n > 1) if the manager can (a state group may have no free slot)."""
        if not self.manager.can_fork(parent, parent.num_computed_tokens):
            slots = self.manager.state_slots
            assert slots is not None and not slots.num_free_slots
            return None
        child = parent.fork(self.new_id())
        self.manager.fork(parent, child)
        self.requests[child.request_id] = child
        return child

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.manager.free(self.requests.pop(rid))
        self.scheduled.pop(rid, None)

    @precondition(lambda self: self.running_ids())
    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        rid = data.draw(st.sampled_from(self.running_ids()))
        request = self.requests.pop(rid)
        self.manager.free(request)
        self.scheduled.pop(rid, None)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @precondition(lambda self: self.running_ids())
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(self.running_ids()))
        before = self.snapshot()
        plan = self.manager.swap_out(self.requests[rid])
        if plan is None:
            assert self.snapshot() == before
            return
        self.scheduled.pop(rid, None)
        assert len(plan.pairs) <= len(self.manager.tables.requests[rid].host_slot_ids)

    @precondition(lambda self: self.swapped_ids())
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(self.swapped_ids()))
        before = self.snapshot()
        plan = self.manager.swap_in(self.requests[rid])
        if plan is None:
            assert self.snapshot() == before
            return
        assert [d for _, d in plan.pairs] == [
            p for g in range(len(self.WINDOWS)) for p in self.manager.page_ids(rid, g) if p]

    @rule(max_num_pages=st.one_of(st.none(), st.integers(0, 4)))
    def evict(self, max_num_pages):
        self.manager.evict_cached_pages(max_num_pages)

    def schedule_pass(self, data):
        """A continuous-batching pass: maybe a fork (n > 1), running requests, waiting ones."""
        candidates = self.running_ids(unscheduled=True)
        if candidates and data.draw(st.booleans()):
            self.fork(data)
        for rid in self.running_ids(unscheduled=True):
            request = self.requests[rid]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining and not self.schedule(request, data.draw(st.integers(1, remaining))):
                return  # the pool is short; preemption is left to the other rules
        for request in list(self.waiting):
            hit_ids, num_hit = self.manager.get_computed_pages(request)
            chunk = data.draw(st.integers(1, request.num_tokens - num_hit))
            if not self.schedule(request, chunk, hit_ids, num_hit):
                return
            self.waiting.remove(request)
            self.requests[request.request_id] = request

    @rule(data=st.data(), schedule_everyone=st.booleans())
    def step(self, data, schedule_everyone):
        if schedule_everyone:
            self.schedule_pass(data)
        plans = self.manager.take_plans()
        for pairs in (plans.swap_out.pairs, plans.swap_in.pairs, plans.copy.pairs):
            assert len({dst for _, dst in pairs}) == len(pairs), "two moves into one place"
        assert not {s for s, _ in plans.copy.pairs} & {d for _, d in plans.copy.pairs}
        # Vectorized, as the runner does them: each kind reads before it writes.
        out, into, cp = (p.as_array() for p in (plans.swap_out, plans.swap_in, plans.copy))
        self.host[out[:, 1]] = self.device[out[:, 0]]
        self.device[into[:, 1]] = self.host[into[:, 0]]
        self.device[cp[:, 1]] = self.device[cp[:, 0]]
        self.run_state_moves(plans.state)
        for rid, num_new in self.scheduled.items():
            request = self.requests[rid]
            self.write_state(request, num_new)
            for g in range(len(self.WINDOWS)):
                page_ids = self.manager.page_ids(rid, g)
                for pos in range(request.num_computed_tokens,
                                 request.num_computed_tokens + num_new):
                    assert page_ids[pos // PS] != NULL_PAGE_ID, "a write into the null page"
                    value = fingerprint(request.all_token_ids, pos)
                    self.device[page_ids[pos // PS], pos % PS] = value
            request.num_computed_tokens += num_new
            self.settle(request, num_new)
        self.scheduled.clear()
        for rid in self.running_ids():
            request = self.requests[rid]
            if request.num_computed_tokens == request.num_tokens:
                if request.num_tokens >= MAX_TOKENS:
                    self.manager.free(self.requests.pop(rid))  # finished
                    continue
                samples = [request]
                if data.draw(st.integers(0, 3)) == 0:  # n > 1: samples diverge from here
                    samples.append(self.fork_child(request))
                for sample in filter(None, samples):
                    sample.append_output_token_ids(data.draw(TOKENS))
        self.check_contents()

    def check_contents(self):
        for rid, request in self.requests.items():
            for g, w in enumerate(self.WINDOWS):
                if self.manager.is_swapped(rid):
                    memory, ids = self.host, self.manager.tables.requests[rid].host_tables[g]
                else:
                    memory, ids = self.device, self.manager.page_ids(rid, g)
                # what the next query (at num_computed_tokens) reads: a window, or all
                c = request.num_computed_tokens
                for pos in range(max(0, c - w + 1) if w else 0, c):
                    expected = fingerprint(request.all_token_ids, pos)
                    assert ids[pos // PS] > 0 if not self.manager.is_swapped(rid) else (
                        ids[pos // PS] >= 0), f"{rid} lost the page of position {pos} (group {g})"
                    assert memory[ids[pos // PS], pos % PS] == expected, (
                        f"{rid} reads a wrong KV at position {pos} (group {g})")

    # ---------------------------------------------------------- invariants
    @invariant()
    def pages_are_consistent(self):
        manager, pool = self.manager, self.manager.pool
        holders = Counter()
        for rid in [rid for rid in manager.tables.requests if not manager.is_swapped(rid)]:
            for g, w in enumerate(self.WINDOWS):
                page_ids = manager.page_ids(rid, g)
                held = [p for p in page_ids if p != NULL_PAGE_ID]
                assert len(set(held)) == len(held), f"{rid} holds a page twice"
                if not w:
                    assert NULL_PAGE_ID not in page_ids
                else:  # only a leading run of entries is given back
                    assert NULL_PAGE_ID not in page_ids[len(page_ids) - len(held):]
                holders.update(held)
        holders.update(manager.tables.pending.pins)
        for page in pool.pages:
            assert page.ref_cnt == holders[page.page_id], f"page {page.page_id} ref count"
        assert pool.null_page.ref_cnt == 0 and pool.null_page.prev_free is None
        queued = [p.page_id for p in pool.free_queue]
        assert sorted(queued) == [p.page_id for p in pool.pages[1:] if p.ref_cnt == 0]
        stats = manager.stats()
        assert (stats.num_free_pages + stats.num_used_pages + stats.num_cached_pages
                == self.num_pages - 1)
        assert stats.num_cached_pages == sum(
            1 for p in pool.pages if p.ref_cnt == 0 and p.page_hash is not None)
        index = pool.prefix_cache._pages if pool.prefix_cache is not None else {}
        assert len(index) == sum(1 for p in pool.pages if p.page_hash is not None)
        assert all(p.page_hash == h for h, p in index.items())
        assert 0.0 <= stats.internal_fragmentation < 1.0

    @invariant()
    def host_slots_are_consistent(self):
        manager = self.manager
        held = [s for state in manager.tables.requests.values() for s in state.host_slot_ids or ()]
        pending = manager.tables.pending
        everything = held + pending.deferred_slot_ids + manager.host_pool._free_slot_ids
        assert sorted(everything) == list(range(NUM_HOST_SLOTS))
        assert {rid for rid in self.requests if manager.has_request(rid)} == set(self.requests)

    def teardown(self):
        for request in list(self.requests.values()):
            self.manager.free(request)
        self.manager.take_plans()
        stats = self.manager.stats()
        assert stats.num_used_pages == 0 and self.manager.tables.pending.is_empty()
        assert stats.num_free_pages + stats.num_cached_pages == self.num_pages - 1
        assert stats.num_free_host_slots == NUM_HOST_SLOTS
        assert all(p.ref_cnt == 0 for p in self.manager.pool.pages)


KVCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCacheProperties = KVCacheMachine.TestCase


class HybridKVCacheMachine(KVCacheMachine):
    """The same with a full-attention group beside two sliding-window groups."""

    WINDOWS = (0, 5, 6)


HybridKVCacheMachine.TestCase.settings = KVCacheMachine.TestCase.settings
TestHybridKVCacheProperties = HybridKVCacheMachine.TestCase

"""Stateful property test of the state group: the KV machine of test_kv_properties.py with a
state slot per request, a simulated state pool and host copies of it, and speculative
decoding's backups (a verify step backs the state up; a rejection poisons the state, reads
the backup back and takes the step's progress back).

Each state slot holds the fingerprint of the last token its request's state has taken in;
the machine executes the state plans (swap-out, copy as one gather and one scatter,
swap-in) before each step, checks every step's state read (a step from position 0 starts
from zero) and that every request, on the device or swapped out, holds its own state. With
snapshot slots (`SnapshotKVCacheMachine`) prefix caching is on: a hit resumes a snapshot,
which the hit's first state read checks like any other.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from jaxserve.core.state_slots import StateGroupSpec
from jaxserve.request import Request
from tests.core.test_kv_properties import KVCacheMachine, fingerprint

NUM_REQUEST_SLOTS = 5  # 4 usable: fewer than the pool's pages hold requests, so slots run out
NUM_BACKUP_SLOTS = 2  # fewer than the requests: a verify may find none
NUM_STATE_SLOTS = NUM_REQUEST_SLOTS + NUM_BACKUP_SLOTS
NUM_HOST_STATE_SLOTS = 3
NUM_SNAPSHOTS = 2
POISON = -99  # a state advanced over rejected proposals


class StateKVCacheMachine(KVCacheMachine):
    STATE_GROUP = StateGroupSpec(NUM_STATE_SLOTS, 64, NUM_HOST_STATE_SLOTS,
                                 num_backup_slots=NUM_BACKUP_SLOTS)

    def __init__(self):
        super().__init__()
        self.verifying: dict[str, bool] = {}  # scheduled verify steps -> every proposal held
        self.state = np.full(self.STATE_GROUP.num_rows, -1, dtype=np.int64)
        self.host_state = np.full(NUM_HOST_STATE_SLOTS, -2, dtype=np.int64)
        self.caching = bool(self.STATE_GROUP.num_snapshot_slots)
        assert (self.manager.pool.prefix_cache is not None) == self.caching
        assert bool(self.manager.prefix_caching_disabled_reason) != self.caching

    def state_snapshot(self):
        slots = self.manager.state_slots
        snaps = self.manager.snapshots
        return (dict(slots.slot_of), dict(slots.host_slot_of), list(slots._free),
                list(slots._host_free), dict(slots._source), list(slots._swap_out_pairs),
                list(slots._deferred_host), dict(slots.backups.backup_of),
                list(slots.backups._free),
                snaps and (list(snaps._index), list(snaps._free), dict(snaps._noted)))

    def verifiable_ids(self) -> list[str]:
        slots = self.manager.state_slots
        return [rid for rid in self.running_ids(unscheduled=True) if slots.can_back_up(rid)
                and self.requests[rid].num_computed_tokens < self.requests[rid].num_tokens]

    @precondition(lambda self: self.verifiable_ids())
    @rule(data=st.data())
    def verify(self, data):
        """A verify step: the state is backed up, then the step runs its tokens."""
        rid = data.draw(st.sampled_from(self.verifiable_ids()))
        request = self.requests[rid]
        if self.schedule(request, request.num_tokens - request.num_computed_tokens):
            self.manager.state_slots.back_up(rid)
            self.verifying[rid] = data.draw(st.booleans())

    def settle(self, request: Request, num_new: int) -> None:
        held = self.verifying.pop(request.request_id, None)
        slots = self.manager.state_slots
        if held is None or not slots.backups.holds(request.request_id):
            return  # no verify step, or its backup went with a preemption (as settle_state)
        if held:
            slots.drop_backup(request.request_id)
            return
        self.state[slots.slot(request.request_id)] = POISON  # it took rejected proposals
        assert slots.restore_backup(request.request_id)
        request.num_computed_tokens -= num_new  # computed again from the backup's state

    @rule(data=st.data(), schedule_everyone=st.booleans())
    def step(self, data, schedule_everyone):
        super().step(data, schedule_everyone)
        self.verifying.clear()  # verify steps of requests preempted or freed before they ran

    def run_state_moves(self, plans) -> None:
        for pairs in (plans.swap_out.pairs, plans.copy.pairs, plans.swap_in.pairs):
            assert len({dst for _, dst in pairs}) == len(pairs), "two moves into one slot"
        out, cp, into = (p.as_array() for p in (plans.swap_out, plans.copy, plans.swap_in))
        assert not (cp == 0).any() and not (into[:, 1] == 0).any()  # never the null slot
        self.host_state[out[:, 1]] = self.state[out[:, 0]]
        self.state[cp[:, 1]] = self.state[cp[:, 0]]  # NOTE: numpy gathers before it scatters
        self.state[into[:, 1]] = self.host_state[into[:, 0]]

    def write_state(self, request: Request, num_new: int) -> None:
        slot, start = self.manager.state_slot(request.request_id), request.num_computed_tokens
        if start:
            assert self.state[slot] == fingerprint(request.all_token_ids, start - 1), (
                f"{request.request_id} reads a wrong state at {start} (slot {slot})")
        self.state[slot] = fingerprint(request.all_token_ids, start + num_new - 1)

    def check_contents(self):
        super().check_contents()
        slots = self.manager.state_slots
        for rid, request in self.requests.items():
            if not request.num_computed_tokens:
                continue  # its next step starts from zero
            if rid in slots.host_slot_of:
                value = self.host_state[slots.host_slot_of[rid]]
            else:  # a fork of this step reads its parent's state at the next `take`
                kind, index = slots._source.get(rid, ("slot", slots.slot(rid)))
                value = (self.state if kind == "slot" else self.host_state)[index]
            assert value == fingerprint(request.all_token_ids, request.num_computed_tokens - 1), (
                f"{rid} lost its state")

    @invariant()
    def state_slots_are_consistent(self):
        slots = self.manager.state_slots
        on_device = {rid for rid in self.requests if not self.manager.is_swapped(rid)}
        assert set(slots.slot_of) == on_device  # one slot per request holding device pages
        assert set(slots.host_slot_of) == set(self.requests) - on_device  # host slots only
        held = list(slots.slot_of.values())
        group = self.STATE_GROUP
        assert sorted(held + slots._free) == list(range(1, group.num_request_slots))
        backups = slots.backups.backup_of  # only running requests', between a verify and its step
        assert set(backups) <= set(slots.slot_of) and set(backups) <= set(self.verifying)
        assert sorted([*backups.values(), *slots.backups._free]) == list(
            range(group.num_request_slots, group.num_slots))
        host = list(slots.host_slot_of.values()) + slots._deferred_host + slots._host_free
        assert sorted(host) == list(range(NUM_HOST_STATE_SLOTS))
        if not self.caching:
            probe = Request("probe", [0, 1, 2, 0, 1, 2, 0, 1, 0])
            assert not self.manager.get_computed_pages(probe)[1]
            return
        snaps = self.manager.snapshots  # every snapshot slot held by one snapshot or free
        assert sorted(snaps.held_slots() + snaps._free) == list(
            range(group.num_slots, group.num_rows))

    def teardown(self):
        super().teardown()
        slots = self.manager.state_slots
        assert not slots.slot_of and not slots.host_slot_of
        assert slots.num_free_slots == self.STATE_GROUP.num_request_slots - 1
        assert slots.backups.num_free == self.STATE_GROUP.num_backup_slots
        assert slots.num_free_host_slots == NUM_HOST_STATE_SLOTS
        if self.caching:  # apart from the request slots, only snapshots hold rows
            snaps = self.manager.snapshots
            assert len(snaps.held_slots()) + snaps.num_free_slots == NUM_SNAPSHOTS


StateKVCacheMachine.TestCase.settings = KVCacheMachine.TestCase.settings
TestStateKVCacheProperties = StateKVCacheMachine.TestCase


class SnapshotKVCacheMachine(StateKVCacheMachine):
    """The same with prefix caching on: two snapshot slots after the requests' slots (no
    backups: this machine's verify steps carry no proposals, which a snapshot must not see)."""

    STATE_GROUP = StateGroupSpec(NUM_REQUEST_SLOTS, 64, NUM_HOST_STATE_SLOTS,
                                 num_snapshot_slots=NUM_SNAPSHOTS)


SnapshotKVCacheMachine.TestCase.settings = KVCacheMachine.TestCase.settings
TestSnapshotKVCacheProperties = SnapshotKVCacheMachine.TestCase

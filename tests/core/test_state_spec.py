"""Speculative decoding with a state group (scheduler and KV manager, fake runner): a verifying
request's state is backed up before its step, dropped when every proposal holds, read back on
a rejection with the accepted tokens recomputed; preemption and aborts leak no slot."""

from __future__ import annotations

import random

import pytest

from jaxserve.request import RequestStatus
from tests.core.scheduler_harness import Harness, default_token, make_request, make_scheduler


def spec_harness(accept, k: int = 3, **kwargs) -> Harness:
    """A state group with a backup slot per sequence; proposals that `default_token` makes,
    of which `accept(request, proposals)` hold."""
    def propose(request):
        return [default_token(request, request.sample_index) + i for i in range(k)]
    return Harness(make_scheduler(budget=64, max_num_seqs=16, state=True, state_backups=16,
                                  **kwargs), propose=propose, accept=accept)


def test_a_rejection_reads_the_state_back_and_recomputes_the_accepted_tokens():
    h = spec_harness(lambda r, p: 1)
    h.add(make_request("a", 5, max_tokens=12))
    h.step()  # the prompt
    request, slot = h.seen["a"], h.kv.state_slot("a")
    out, ((_, tokens),) = h.step()  # token 5 and 3 proposals, the first accepted
    (entry,) = out.scheduled
    backup = h.kv.state_slots.num_request_slots  # the first backup row
    assert entry.num_spec_tokens == 3 and out.plans.state.copy.pairs == [(slot, backup)]
    assert tokens == [11, 12] and request.num_tokens == 8
    assert request.num_computed_tokens == entry.start_pos == 5  # rolled back
    out, _ = h.step()  # the state again over tokens 5 and 6, then the new token 7
    (entry,) = out.scheduled
    assert out.plans.state.copy.pairs == [(backup, slot)]
    assert (entry.start_pos, entry.num_new_tokens, entry.num_spec_tokens) == (5, 3, 0)
    assert h.kv.state_slots.backups.num_restores == 1
    h.run()  # the harness checks every step's state read
    assert request.output_token_ids == [10 + i for i in range(12)]


def test_all_proposals_accepted_keep_the_state_and_decoding_goes_on():
    h = spec_harness(lambda r, p: len(p))
    h.add(make_request("a", 5, max_tokens=12))
    h.step()
    out, _ = h.step()
    assert out.scheduled[0].num_spec_tokens == 3
    out, _ = h.step()  # straight on: a decode token and proposals, no restore
    assert out.scheduled[0].start_pos == 9 and out.scheduled[0].num_spec_tokens == 3
    backup = h.kv.state_slots.num_request_slots  # the first backup row, free again
    assert out.plans.state.copy.pairs == [(h.kv.state_slot("a"), backup)]
    h.run()
    assert h.kv.state_slots.backups.num_restores == 0
    assert h.seen["a"].output_token_ids == [10 + i for i in range(12)]


def test_a_verify_step_that_never_ran_gives_its_backup_back():
    h = spec_harness(lambda r, p: 0)
    h.add(make_request("a", 5, max_tokens=12))
    h.step()
    h.sched.set_proposals({"a": [11, 12, 13]})
    out = h.sched.schedule()
    assert out.scheduled[0].num_spec_tokens and h.kv.state_slots.backups.holds("a")
    h.sched.unschedule(out)
    assert not h.kv.state_slots.backups.holds("a")
    assert h.seen["a"].num_computed_tokens == 5
    h.run()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_aborts_with_backups_leak_nothing(mode):
    """Requests verify in every step while the pool forces preemption; a rejection at
    random; one request aborted: every state read is right and every slot comes back."""
    rng = random.Random(3)
    h = spec_harness(lambda r, p: rng.randint(0, len(p)), num_pages=9, host_slots=8,
                     preemption_mode=mode)
    h.add(*(make_request(x, 7, max_tokens=14, arrival=i) for i, x in enumerate("abcd")))
    for _ in range(4):
        h.step()
    h.sched.finish_request("d", RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.sched.num_preemptions > 0 and h.kv.state_slots.backups.num_restores > 0
    for x in "abc":
        assert h.seen[x].output_token_ids == [10 + i for i in range(14)]

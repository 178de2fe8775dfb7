"""Scheduling proposals for speculative decoding (issue 14): 1 + k tokens per decoding
request, slots reserved as lookahead, progress only for accepted proposals, stop checks
on every verified token, never a preemption for proposals. Fake runner (no JAX)."""

from __future__ import annotations

import random

import pytest

from jaxserve.request import RequestStatus
from tests.core.scheduler_harness import (
    EOS,
    Harness,
    default_token,
    make_request,
    make_scheduler,
)


def proposer(k: int):
    """Proposes what `default_token` would produce next (so accepting is consistent)."""
    def propose(request):
        base = default_token(request, request.sample_index)
        return [base + i for i in range(k)]
    return propose


# A state group (linear-attention layers): verifying requests' states backed up first, read
# back on a rejection; 2 backup slots for up to 6 requests, so some verify nothing.
STATE = dict(state=True, state_backups=2)


@pytest.mark.parametrize(("windows", "extra"), [((0,), {}), ((0, 5, 5), {}), ((0,), STATE)],
                         ids=["one-group", "hybrid", "state"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(6))
def test_soak_with_random_acceptance_and_preemption(mode, seed, windows, extra):
    rng = random.Random(seed)
    h = Harness(make_scheduler(num_pages=13 * len(windows) + 1, budget=16, host_slots=16,
                               preemption_mode=mode, group_windows=windows, **extra),
                propose=proposer(3), accept=lambda r, p: rng.randint(0, len(p)))
    lengths = {}
    for i in range(6):
        max_tokens = rng.randint(1, 14)
        h.add(make_request(f"r{i}", rng.randint(1, 12), max_tokens=max_tokens, arrival=i))
        lengths[f"r{i}"] = max_tokens
    for step in range(500):
        h.step()
        if step == 6:  # an abort, maybe of a request holding a backup
            h.sched.finish_request("r0", RequestStatus.FINISHED_ABORTED)
            lengths.pop("r0")
        if step > 6 and not h.sched.has_unfinished_requests():
            break
    h.check_drained()
    assert sum(o.num_spec_tokens for out in h.outputs for o in out.scheduled) > 0
    if extra:
        assert h.kv.state_slots.backups.num_restores > 0
    for rid, max_tokens in lengths.items():
        request = h.seen[rid]
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        # Exactly max_tokens tokens, each the one default_token gives at its index.
        assert request.output_token_ids == [10 + i for i in range(max_tokens)], rid


def test_proposals_respect_max_tokens_and_the_budget():
    h = Harness(make_scheduler(budget=6), propose=proposer(4), accept=lambda r, p: len(p))
    h.add(make_request("a", 3, max_tokens=4), make_request("b", 3, max_tokens=10, arrival=1))
    h.step()  # prompts
    out, results = h.step()
    by_id = {e.request_id: e for e in out.scheduled}
    assert by_id["a"].num_spec_tokens == 2  # 1 token out, room for 3: 2 proposals + bonus
    assert by_id["b"].num_spec_tokens == 2  # what the budget of 6 leaves after "a"'s 3
    assert out.total_num_scheduled_tokens == 6
    assert {r.request_id: len(t) for r, t in results} == {"a": 3, "b": 3}
    assert h.seen["a"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    h.run()


def test_a_stop_token_among_accepted_proposals_ends_the_request_there():
    def propose(request):
        return [50, EOS, 51]
    h = Harness(make_scheduler(), propose=propose, accept=lambda r, p: len(p))
    h.add(make_request("a", 5, max_tokens=20))
    h.step()
    _, results = h.step()
    ((request, tokens),) = results
    assert tokens == [50, EOS] and request.output_token_ids == [10, 50, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED
    h.check_drained()


def test_no_one_is_preempted_for_proposals():
    # 5 usable pages of 4 slots: "a" and "b" fill 4 of them; proposals would need more.
    h = Harness(make_scheduler(num_pages=6, budget=32), propose=proposer(8),
                accept=lambda r, p: 0)
    h.add(make_request("a", 7, max_tokens=20), make_request("b", 7, max_tokens=20, arrival=1))
    h.step()
    out, _ = h.step()
    assert not out.preempted_request_ids
    assert sorted(e.request_id for e in out.scheduled) == ["a", "b"]
    h.run()


def test_rejected_proposals_do_not_count_as_progress():
    h = Harness(make_scheduler(), propose=proposer(3), accept=lambda r, p: 1)
    h.add(make_request("a", 5, max_tokens=20))
    h.step()
    request = h.seen["a"]
    before = request.num_computed_tokens
    h.step()
    assert request.num_computed_tokens == before + 2  # the decode token and 1 proposal
    assert request.num_tokens == request.num_computed_tokens + 1
    h.run()


def test_pages_only_rejected_proposals_used_are_freed():
    """Proposals reach two pages past the request's tokens; all are rejected: those pages
    go back to the pool at once (they are allocated again when needed)."""
    h = Harness(make_scheduler(num_pages=16, budget=32), propose=proposer(8),
                accept=lambda r, p: 0)
    h.add(make_request("a", 4, max_tokens=20))  # 4 prompt tokens fill page 0
    h.step()
    request = h.seen["a"]
    used_before = h.kv.pool.num_used_pages
    out, _ = h.step()  # token 5 at position 4 plus 8 proposals: slots 4..12, pages 1..3
    assert out.scheduled[0].num_spec_tokens == 8
    assert len(h.kv.page_ids("a")) == 2  # tokens 0..5: pages 0 and 1
    assert h.kv.pool.num_used_pages == used_before + 1
    assert request.num_computed_tokens == 5
    h.run()

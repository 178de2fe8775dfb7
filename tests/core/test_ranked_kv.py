"""RankedKVCacheManager (data-parallel attention, host side): global ids, rank assignment,
per-rank preemption, and a soak of the real Scheduler over it."""

from __future__ import annotations

import random

import pytest

from jaxserve.core import KVCacheManager, RankedKVCacheManager
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.core.state_slots import StateGroupSpec
from jaxserve.request import RequestStatus
from tests.core.kv_helpers import admit, decode
from tests.core.ranked_harness import RankedHarness, ranked_scheduler
from tests.core.scheduler_harness import EOS, HOST_PAGE_BYTES, PS, make_request


def make(num_ranks: int = 2, num_pages: int = 18, **kwargs) -> RankedKVCacheManager:
    kwargs.setdefault("watermark", 0.0)
    return RankedKVCacheManager(num_ranks, num_pages, PS, **kwargs)


def check_on_rank(kv: RankedKVCacheManager, request_id: str, rank: int) -> None:
    """The request's pages lie in its rank's range, never its null page, and are the rank's
    own local ones shifted by `rank * P`."""
    assert kv.rank_of(request_id) == rank
    for g in range(kv.num_groups):
        ids = kv.page_ids(request_id, g)
        assert all(p in kv.page_range(rank)[1:] for p in ids), ids
        local = kv.ranks[rank].page_ids(request_id, g)
        assert ids == [rank * kv.pages_per_rank + p for p in local]


def test_one_manager_is_one_rank():
    kv = KVCacheManager(9, PS)
    assert kv.num_ranks == 1 and kv.rank_of("anything") == 0


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_requests_spread_over_the_ranks_fewest_live_first(num_ranks):
    kv = make(num_ranks, 9 * num_ranks)
    requests = [make_request(f"r{i}", 5) for i in range(2 * num_ranks)]
    for r in requests:
        _, new_ids = admit(kv, r)
        assert new_ids is not None
    assert [kv.rank_of(r.request_id) for r in requests] == list(range(num_ranks)) * 2
    for r in requests:
        check_on_rank(kv, r.request_id, kv.rank_of(r.request_id))
    kv.free(requests[num_ranks - 1])  # its rank now has the fewest live requests
    assert not kv.has_request(requests[num_ranks - 1].request_id)
    late = make_request("late", 5)
    admit(kv, late)
    assert kv.rank_of("late") == num_ranks - 1
    assert [kv.num_live(r) for r in range(num_ranks)] == [2] * num_ranks


def test_a_request_goes_where_its_first_chunk_fits():
    kv = make(2, 18)  # 8 usable pages per rank
    admit(kv, make_request("big", 28))  # 7 pages of rank 0
    admit(kv, make_request("small", 3))  # rank 1: fewest live
    # NOTE: equal load, so rank 0 would come first; its one free page is too few.
    admit(kv, make_request("two_pages", 8))
    assert kv.rank_of("two_pages") == 1
    check_on_rank(kv, "two_pages", 1)


def test_a_prefix_hit_steers_an_equal_load_choice_to_its_rank():
    kv = make(2, 18)
    shared = list(range(100, 108))  # two full pages
    admit(kv, make_request("other", 6))  # rank 0
    admit(kv, make_request("first", shared + [1]))  # rank 1 caches the prefix
    assert kv.rank_of("first") == 1
    second = make_request("second", shared + [2])
    hit_ids, num_hit = kv.get_computed_pages(second)
    assert num_hit == 8 and hit_ids == kv.page_ids("first")[:2]
    kv.allocate_slots(second, second.num_tokens - num_hit, num_hit, hit_ids)
    check_on_rank(kv, "second", 1)
    assert kv.stats().prefix_hits == 8
    # Load first: rank 1 now has one more live request, so the prefix does not pull there.
    third = make_request("third", shared + [3])
    assert kv.get_computed_pages(third) == ([], 0)
    admit(kv, third)
    assert kv.rank_of("third") == 0


def test_a_fork_stays_on_its_parents_rank_and_copies_there():
    kv = make(2, 18, swap_space=4.0, bytes_per_page=HOST_PAGE_BYTES)
    admit(kv, make_request("other", 4))
    parent = make_request("parent", 6)
    admit(kv, parent)
    assert kv.rank_of("parent") == 1
    child = parent.fork("child")
    kv.fork(parent, child)
    assert kv.rank_of("child") == 1 and kv.page_ids("child") == kv.page_ids("parent")
    decode(kv, child, 7)  # writes into the shared, partly filled page: copy-on-write
    plans = kv.take_plans()
    (src, dst), = plans.copy.pairs
    assert src == kv.page_ids("parent")[1] and dst == kv.page_ids("child")[1]
    check_on_rank(kv, "child", 1)


def test_swap_plans_are_in_global_page_and_host_slot_ids():
    kv = make(2, 18, swap_space=4.0, bytes_per_page=HOST_PAGE_BYTES)
    assert kv.host_slots_per_rank == 2 and kv.host_pool.num_slots == 4
    admit(kv, make_request("other", 4))
    request = make_request("r", 6)
    admit(kv, request)
    pages = kv.page_ids("r")
    out = kv.swap_out(request)
    assert kv.is_swapped("r") and kv.rank_of("r") == 1
    assert [p for p, _ in out.pairs] == pages and {s for _, s in out.pairs} == {2, 3}
    assert kv.take_plans().swap_out.pairs == out.pairs
    assert kv.can_swap_in(request, 1)
    back = kv.swap_in(request)
    assert [s for s, _ in back.pairs] == [s for _, s in out.pairs]
    assert [p for _, p in back.pairs] == kv.page_ids("r")
    assert kv.take_plans().swap_in.pairs == back.pairs
    check_on_rank(kv, "r", 1)


def test_several_kv_cache_groups_work_per_rank():
    kv = make(2, 2 * 17, group_windows=(0, 8))
    for i in range(3):
        admit(kv, make_request(f"r{i}", 9))
    for i, rank in enumerate([0, 1, 0]):
        check_on_rank(kv, f"r{i}", rank)
        deltas = kv.page_deltas(f"r{i}")
        assert [ids for _, ids in deltas] == [kv.page_ids(f"r{i}", g) for g in range(2)]


def test_aggregates_sum_over_the_ranks():
    kv = make(2, 18, swap_space=4.0, bytes_per_page=HOST_PAGE_BYTES)
    requests = [make_request(f"r{i}", 8) for i in range(3)]  # 2 full pages each
    for r in requests:
        admit(kv, r)
    stats = kv.stats()
    assert (stats.num_total_pages, stats.num_used_pages) == (16, 6)
    assert kv.usage == stats.usage == 6 / 16 and kv.pool.num_used_pages == 6
    assert stats.num_total_host_slots == kv.host_pool.num_slots == 4
    assert kv.max_tokens_per_request == 8 * PS  # one rank's pages
    for r in requests:
        kv.free(r)
    assert sorted(kv.take_released()) == ["r0", "r1", "r2"]
    assert kv.pool.num_cached_free_pages == 6 and kv.pool.prefix_cache is not None
    assert kv.evict_cached_pages(1) == 1 and kv.evict_cached_pages() == 5
    assert kv.pool.num_allocatable_pages == kv.pool.num_usable_pages == 16


def test_bad_sizes_and_misuse_are_value_errors():
    with pytest.raises(ValueError, match="num_pages=20 must be divisible by num_ranks=3"):
        RankedKVCacheManager(3, 20, PS)
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        RankedKVCacheManager(0, 20, PS)
    with pytest.raises(ValueError, match=r"linear-attention layers \(state_group\)"):
        RankedKVCacheManager(2, 18, PS, state_group=StateGroupSpec(5, 1))
    kv = make(2, 18)
    request = make_request("r", 9)
    with pytest.raises(ValueError, match="holds no KV"):
        kv.rank_of("r")
    with pytest.raises(ValueError, match="holds no KV"):
        kv.free(request)
    with pytest.raises(ValueError, match="holds no KV"):
        kv.fork(request, request.fork("child"))
    assert not kv.can_fork(request, 1) and kv.trim(request) == 0
    with pytest.raises(ValueError, match="must lie on one attention rank"):
        kv.allocate_slots(request, 1, 8, [1, 10])
    with pytest.raises(ValueError, match="must lie on one attention rank"):
        kv.allocate_slots(request, 1, 8, [40, 41])
    admit(kv, request)
    with pytest.raises(ValueError, match="already holds KV"):
        kv.get_computed_pages(request)
    with pytest.raises(ValueError, match="already holds KV"):
        kv.fork(request, request)


def test_allocation_fails_where_no_rank_has_room():
    kv = make(2, 10)  # 4 usable pages per rank
    admit(kv, make_request("a", 16))
    admit(kv, make_request("b", 16))
    late = make_request("late", 4)
    assert kv.get_computed_pages(late) == ([], 0)
    assert kv.allocate_slots(late, 4) is None and not kv.has_request("late")


def test_decodes_first_keeps_each_ranks_entries_together_decodes_first():
    def entry(rid, rank, n):
        return ScheduledRequest(rid, [5] * n, 0, [], 1, rank=rank)

    out = SchedulerOutput(scheduled=[entry("a", 1, 3), entry("b", 0, 1), entry("c", 1, 1),
                                     entry("d", 0, 4), entry("e", 1, 1), entry("f", 0, 1)])
    assert [s.request_id for s in out.decodes_first().scheduled] == ["b", "f", "d", "c", "e", "a"]
    one = [entry(r, 0, n) for r, n in zip("abcd", [3, 1, 2, 1], strict=True)]
    assert (SchedulerOutput(scheduled=list(one)).decodes_first().scheduled
            == SchedulerOutput(scheduled=list(one)).decodes_first().scheduled)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_picks_a_victim_on_the_rank_that_ran_out(mode):
    sched = ranked_scheduler(2, 18, preemption_mode=mode, host_slots=8)
    h = RankedHarness(sched)
    kv = sched.kv
    h.add(make_request("a", 13, max_tokens=30), make_request("x", 4, max_tokens=30))
    h.step()
    h.add(make_request("c", 13, max_tokens=30))  # equal load: rank 0, beside a
    h.step()
    sched.finish_request("x", RequestStatus.FINISHED_ABORTED)
    h.add(make_request("b", 4, max_tokens=30))  # rank 1 is empty now
    h.step()
    assert [(r.request_id, kv.rank_of(r.request_id)) for r in sched.running] == [
        ("a", 0), ("c", 0), ("b", 1)]
    for _ in range(10):  # a and c fill rank 0; b, the latest admitted, has room on rank 1
        out, _ = h.step()
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["c"]
    assert [r.request_id for r in sched.running] == ["a", "b"]
    if mode == "swap":
        assert kv.is_swapped("c") and kv.rank_of("c") == 0
        assert {s for _, s in out.plans.swap_out.pairs} <= set(range(kv.host_slots_per_rank))
    h.run()
    preempted = [rid for o in h.outputs for rid in o.preempted_request_ids]
    assert "b" not in preempted and {h.last_rank[rid] for rid in preempted} == {0}


SOAK_CONFIGS = [  # host_slots: per rank
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap", "host_slots": 6},
    {"preemption_mode": "swap", "host_slots": 3, "scheduling_policy": "priority",
     "long_prefill_token_threshold": 5},
    {"preemption_mode": "recompute", "group_windows": (0, 6), "watermark": 0.1},
]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("config", SOAK_CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
def test_random_soak_over_ranks(config, num_ranks, seed):
    """Random adds, aborts and steps (fan-out, prefix hits, both preemption modes): the
    harness checks every step rank by rank (`RankedHarness`)."""
    rng = random.Random(10 * num_ranks + seed)
    config = dict(config)
    num_groups = len(config.get("group_windows", (0,)))
    pages_per_rank = 8 * num_groups + 1
    config["host_slots"] = config.get("host_slots", 0) * num_ranks
    sched = ranked_scheduler(num_ranks, num_ranks * pages_per_rank, max_model_len=48,
                             budget=rng.choice([8, 16]), max_num_seqs=3 * num_ranks,
                             **config)

    def choose(request, sample_index):
        return EOS if rng.random() < 0.08 else rng.choice([20, 21, 22])

    h = RankedHarness(sched, choose, overlap=bool(seed))
    systems = [[], [5, 6, 7, 8, 5, 6, 7, 8]]
    for step in range(600):
        if step < 40 and rng.random() < 0.3 * num_ranks:
            prompt = rng.choice(systems) + [rng.randrange(30, 40)
                                            for _ in range(rng.randint(1, 20))]
            h.add(make_request(f"s{step}", prompt, max_tokens=rng.randint(1, 20),
                               n=rng.choice([1, 1, 2]), priority=rng.randint(0, 3),
                               arrival=step))
        if sched.requests and rng.random() < 0.03:
            sched.finish_request(rng.choice(sorted(sched.requests)),
                                 RequestStatus.FINISHED_ABORTED)
        h.step()
        if step >= 40 and not sched.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"livelock: {sched.requests}")
    h.check_drained()
    assert h.ranks_seen == set(range(num_ranks))
    assert sched.num_preemptions > 0  # the soak covers preemption


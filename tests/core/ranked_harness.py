"""Scheduler tests over a `RankedKVCacheManager` (data-parallel attention): a builder, and the
scheduler harness with its KV checks done rank by rank."""

from __future__ import annotations

from collections import Counter

from jaxserve.config import SchedulerConfig
from jaxserve.core import RankedKVCacheManager
from jaxserve.core.baseline_schedulers import scheduler_class
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput
from tests.core.scheduler_harness import HOST_PAGE_BYTES, PS, Harness


def ranked_scheduler(num_ranks: int, num_pages: int, *, budget: int = 32,
                     max_model_len: int = 64, host_slots: int = 0, prefix: bool = True,
                     watermark: float = 0.0, group_windows: tuple[int, ...] = (0,),
                     **config) -> Scheduler:
    """`make_scheduler`'s scheduler over a `RankedKVCacheManager` of `num_ranks` ranks
    (`host_slots` in all, split evenly)."""
    kv = RankedKVCacheManager(num_ranks, num_pages, PS, enable_prefix_caching=prefix,
                              watermark=watermark, swap_space=float(host_slots),
                              bytes_per_page=HOST_PAGE_BYTES, max_model_len=max_model_len,
                              group_windows=group_windows, max_chunk_tokens=budget)
    cls = scheduler_class(config.get("scheduling_mode", "continuous+chunked"))
    return cls(SchedulerConfig(**config), kv, max_model_len, budget)


class RankedHarness(Harness):
    """`Harness` (its fake runner keeps one pool of global page ids, so a wrong id reads
    wrong KV) whose KV checks go rank by rank: each request's pages on its rank, never the
    rank's null page where attention reads, every rank's ref counts equal to its requests'
    holdings (no leaks), plans within one rank, entries' `rank` and `decodes_first`'s rank order.

    Attributes:
        last_rank: Each scheduled request's rank when it was last scheduled.
        ranks_seen: The ranks any step scheduled a request on.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_rank: dict[str, int] = {}
        self.ranks_seen: set[int] = set()

    def _check_output(self, out: SchedulerOutput, before, placeholders) -> None:
        super()._check_output(out, before, placeholders)
        kv, ps = self.kv, self.kv.page_size
        size, host = kv.pages_per_rank, kv.host_slots_per_rank
        for entry in out.scheduled:
            rank = entry.rank
            assert rank == kv.rank_of(entry.request_id)
            self.last_rank[entry.request_id] = rank
            self.ranks_seen.add(rank)
            pages = kv.page_range(rank)
            table = self.tables[id(out)][entry.request_id]
            for w, group_table in zip(kv.group_windows, table, strict=True):
                assert all(p in pages for p in group_table), (rank, group_table)
                first = max(0, entry.start_pos - w + 1) // ps if w else 0
                assert pages[0] not in group_table[first:], "attention reads a null page"
        plans = out.plans
        assert all(p // size == s // host and p % size for p, s in plans.swap_out.pairs)
        assert all(p // size == s // host and p % size for s, p in plans.swap_in.pairs)
        assert all(s // size == d // size and s % size and d % size
                   for s, d in plans.copy.pairs)
        ordered = SchedulerOutput(scheduled=list(out.scheduled)).decodes_first().scheduled
        assert sorted(e.request_id for e in ordered) == sorted(out.num_scheduled_tokens)
        assert [e.rank for e in ordered] == sorted(e.rank for e in ordered)

    def _check_state(self) -> None:
        sched, kv, ps = self.sched, self.kv, self.kv.page_size
        queues = [*sched.running, *sched.waiting, *sched.swapped]
        assert len(queues) == len({r.request_id for r in queues}), "a request in two queues"
        assert {r.request_id for r in queues} == set(sched.requests)
        running = {r.request_id for r in sched.running}
        swapped = {r.request_id for r in sched.swapped}
        held = [rid for manager in kv.ranks for rid in manager.tables.requests]
        assert len(held) == len(set(held)) and set(held) == running | swapped
        for r in sched.waiting:
            assert not kv.has_request(r.request_id) and r.num_computed_tokens == 0
        for rank, manager in enumerate(kv.ranks):
            base, holders = rank * kv.pages_per_rank, Counter()
            for rid in manager.tables.requests:
                assert kv.rank_of(rid) == rank and kv.is_swapped(rid) == (rid in swapped)
                if rid not in running:
                    continue
                computed = sched.requests[rid].num_computed_tokens
                for g, w in enumerate(kv.group_windows):
                    ids, local = kv.page_ids(rid, g), manager.page_ids(rid, g)
                    assert ids == [base + p for p in local] and len(ids) * ps >= computed
                    first = max(0, computed - w + 1) // ps if w else 0
                    assert base not in ids[first:computed // ps + 1]
                    holders.update(p for p in local if p)
            # Every page a rank's requests own is on that rank, and nothing else is owned.
            owned = {p.page_id: p.ref_cnt for p in manager.pool.pages if p.ref_cnt}
            assert holders == owned and manager.pool.num_used_pages == len(owned)
            slots = [s for state in manager.tables.requests.values()
                     for s in state.host_slot_ids or ()]
            assert len(slots) == len(set(slots))
            assert manager.host_pool.num_free_slots + len(slots) == manager.host_pool.num_slots

    def check_drained(self) -> None:
        sched, kv = self.sched, self.kv
        assert not (sched.running or sched.waiting or sched.swapped)
        assert kv.usage == 0.0 and kv.pool.num_used_pages == 0
        for manager in kv.ranks:
            pool = manager.pool
            assert pool.num_used_pages == 0 and pool.num_allocatable_pages == pool.num_usable_pages
            assert manager.host_pool.num_free_slots == manager.host_pool.num_slots
            assert not manager.tables.requests and manager.tables.pending.is_empty()
        released = kv.take_released()
        for rows in self.group_rows:
            rows.release(released)
            assert rows.num_kept == 0 and rows.num_free == len(rows.table)

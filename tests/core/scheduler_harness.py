"""A fake runner for scheduler tests: executes KV plans on simulated pages, checks every step.

The fake runner executes each step's KV plans and writes a fingerprint of every token's
prefix into a simulated page pool, then checks that each scheduled request reads its own
prefix back through its block table, which it keeps between steps from the scheduler's
deltas as the runner does (`BlockTableRows`). `Harness.step` also checks the scheduler's contract
(budget, sequence limit, queue order, block tables, ref counts) after every step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from jaxserve.config import SchedulerConfig
from jaxserve.core.baseline_schedulers import scheduler_class as baseline_class
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import PLACEHOLDER, SchedulerOutput
from jaxserve.core.state_slots import StateGroupSpec, default_num_state_slots
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.block_table_rows import BlockTableRows
from jaxserve.sampling_params import SamplingParams

PS = 4
EOS = 2
HOST_PAGE_BYTES = 2**30  # swap_space=N GiB then gives exactly N host slots


def make_scheduler(*, num_pages: int = 33, page_size: int = PS, budget: int = 32,
                   max_model_len: int = 64, host_slots: int = 0, prefix: bool = True,
                   watermark: float = 0.0, group_windows: tuple[int, ...] = (0,),
                   scheduler_class: type[Scheduler] | None = None, state: bool = False,
                   state_host_slots: int | None = None, state_snapshots: int = 0,
                   state_backups: int = 0,
                   **config) -> Scheduler:
    """A scheduler over a fresh KV manager; its class is the one `config`'s
    `scheduling_mode` names (`scheduler_class`) unless one is given. `state`: the manager
    has a state group of `max_num_seqs + 1` slots (`state_host_slots` host slots; None:
    the manager's default), `state_snapshots` snapshot slots (prefix caching's) and
    `state_backups` backup slots besides (speculation)."""
    if scheduler_class is None:
        scheduler_class = baseline_class(config.get("scheduling_mode", "continuous+chunked"))
    num_state = default_num_state_slots(SchedulerConfig(**config).max_num_seqs) + state_backups
    spec = StateGroupSpec(num_state, 1, state_host_slots, num_backup_slots=state_backups,
                          num_snapshot_slots=state_snapshots) if state else None
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=prefix, watermark=watermark,
                        swap_space=float(host_slots), bytes_per_page=HOST_PAGE_BYTES,
                        max_model_len=max_model_len, group_windows=group_windows,
                        max_chunk_tokens=budget, state_group=spec)
    return scheduler_class(SchedulerConfig(**config), kv, max_model_len, budget)


def make_request(request_id: str, prompt: int | list[int], *, max_tokens: int | None = 8,
                 n: int = 1, priority: int = 0, arrival: float = 0.0, **params) -> Request:
    if isinstance(prompt, int):  # a prompt of that length, unique to this request
        base = 1000 + 100 * sum(map(ord, request_id))
        prompt = [base + i for i in range(prompt)]
    return Request(request_id, prompt, arrival_time=arrival, priority=priority,
                   sampling_params=SamplingParams(max_tokens=max_tokens, n=n, **params),
                   eos_token_ids=(EOS,), seeds=tuple(range(n)))


def default_token(request: Request, sample_index: int) -> int:
    """Distinct per completion, never EOS."""
    return 10 + 100 * sample_index + request.num_output_tokens


def prefix_fingerprints(token_ids: list[int]) -> list[int]:
    """One value per position standing for the KV there (it depends on the whole prefix)."""
    fps, h = [], 0
    for t in token_ids:
        h = hash((h, t))
        fps.append(h)
    return fps


class Harness:
    """Drives a scheduler step by step with a fake runner and checks it after every step.

    Args:
        scheduler: The scheduler under test.
        choose: `(request, sample_index) -> token id` for each sampled row.
        overlap: Step as the engine's async scheduling does: each step is scheduled
            before the previous one's samples come back (except after a fan-out step), so
            its decode tokens are placeholders until then.
    """

    def __init__(self, scheduler: Scheduler, choose=default_token, overlap: bool = False,
                 propose=None, accept=None):
        self.sched = scheduler
        # Speculative decoding: `propose(request) -> proposals` before each schedule, and
        # `accept(request, proposals) -> how many the target accepts`.
        self.propose, self.accept = propose, accept
        self.proposed: dict[str, list[int]] = {}
        self.kv = scheduler.kv
        self.choose = choose
        self.device: dict[int, list] = {}  # page id -> fingerprints of its slots
        self.host: dict[int, list] = {}  # host slot -> fingerprints
        # A state group's slots: the fingerprint of the last token each state has taken in.
        self.state_device: dict[int, int | None] = {}
        self.state_host: dict[int, int | None] = {}
        self.outputs: list[SchedulerOutput] = []
        self.seen: dict[str, Request] = {}  # every request added or forked
        self.overlap = overlap
        self.pending: SchedulerOutput | None = None  # overlap: the step "on the device"
        # The runner's kept tables (one set per KV cache group), and each step's tables
        # rebuilt from them: by step, id, group.
        width = scheduler.max_model_len // self.kv.page_size + 1
        self.group_rows = [BlockTableRows(width, 2) for _ in self.kv.group_windows]
        self.rows = self.group_rows[0]
        self.tables: dict[int, dict[str, list[list[int]]]] = {}

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.sched.add_request(request)
            self.seen[request.request_id] = request

    def step(self, sampled: dict[str, list[int]] | None = None):
        """One engine step; returns (scheduler output, update results).

        With `overlap`, the update is that of the previous step (the one "on the device"
        while this one was scheduled), and this step's KV is written after it, when its
        placeholders are known.
        """
        if self.overlap:
            return self._overlapped_step()
        out = self._schedule()
        self._run(out)
        results = self._update(out, sampled)
        return out, results

    def _schedule(self) -> SchedulerOutput:
        sched = self.sched
        before = ([r.request_id for r in sched.running], [r.request_id for r in sched.swapped],
                  [r.request_id for r in sched.waiting])
        placeholders = {rid: r.num_output_placeholders for rid, r in sched.requests.items()}
        if self.propose is not None:
            for r in sched.running:
                r.spec_token_ids = list(self.propose(r))
        self.proposed = {r.request_id: list(r.spec_token_ids) for r in sched.running}
        out = sched.schedule()
        self.outputs.append(out)
        self._kept_tables(out)
        self._check_output(out, before, placeholders)
        self._check_state()
        return out

    def _kept_tables(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """The step's block tables as the runner keeps them from the deltas (built once,
        when the step is scheduled; tests that call `schedule()` themselves get them at
        `_run`)."""
        if id(out) not in self.tables:
            tables: dict[str, list[list[int]]] = {e.request_id: [] for e in out.scheduled}
            for g, rows in enumerate(self.group_rows):
                rows.release(out.released_request_ids)
                entries = out.scheduled if g == 0 else [
                    dataclasses.replace(e, page_ids=e.group_pages[g - 1][1], pages_from=(
                        None if e.pages_from is None else e.group_pages[g - 1][0]))
                    for e in out.scheduled]
                table, lengths = rows.gather(entries, len(entries))
                for i, (e, n) in enumerate(zip(out.scheduled, lengths, strict=True)):
                    tables[e.request_id].append(table[i, :n].tolist())
            self.tables[id(out)] = tables
        return self.tables[id(out)]

    def _update(self, out: SchedulerOutput, sampled=None) -> list:
        if sampled is None:
            sampled = {}
            for entry in out.scheduled:
                request = self.seen[entry.request_id]
                sampled[entry.request_id] = [
                    self.choose(request, k if entry.num_samples > 1 else request.sample_index)
                    for k in range(entry.num_samples)]
                if entry.num_spec_tokens:  # accepted proposals, then the target's own
                    proposals = entry.token_ids[-entry.num_spec_tokens:]
                    accepted = proposals[:self.accept(request, proposals)]
                    sampled[entry.request_id] = accepted + [
                        sampled[entry.request_id][0] + len(accepted)]
        results = self.sched.update_from_output(out, sampled)
        self.seen.update((r.request_id, r) for r, _ in results)
        if self.kv.state_slots is not None and not self.overlap:  # every verify step settled
            assert not self.kv.state_slots.backups.backup_of
        self._check_state()
        return results

    def _overlapped_step(self):
        prev, results = self.pending, []
        if prev is not None and any(e.num_samples > 1 for e in prev.scheduled):
            results = self._update(prev)  # forks need the samples first, as in the engine
            prev = None
        out = self._schedule()
        if prev is not None:
            results = self._update(prev)
        self._run(out)  # after the update: the placeholders' tokens are known now
        self.pending = out if out.scheduled else None
        return out, results

    def run(self, max_steps: int = 500) -> int:
        """Steps until every request ends; returns the number of steps."""
        for num_steps in range(1, max_steps + 1):
            self.step()
            if not self.sched.has_unfinished_requests():
                self.check_drained()
                return num_steps
        raise AssertionError(f"not finished after {max_steps} steps: {self.sched.requests}")

    def check_drained(self) -> None:
        kv = self.kv
        assert not (self.sched.running or self.sched.waiting or self.sched.swapped)
        assert kv.usage == 0.0 and kv.pool.num_used_pages == 0
        assert kv.pool.num_allocatable_pages == kv.pool.num_usable_pages
        assert kv.host_pool.num_free_slots == kv.host_pool.num_slots
        assert not kv.tables.requests and kv.tables.pending.is_empty()
        if kv.state_slots is not None:  # every state slot free, on the device and the host
            assert not kv.state_slots.slot_of and not kv.state_slots.host_slot_of
            assert kv.state_slots.num_free_slots == kv.state_slots.num_request_slots - 1
            backups = kv.state_slots.backups
            assert not backups.backup_of and backups.num_free == backups.num_slots
            assert kv.state_slots.num_free_host_slots == kv.state_slots.num_host_slots
        if kv.snapshots is not None:  # the other rows: held by a snapshot, or free
            snaps, spec = kv.snapshots, kv.state_slots.spec
            assert sorted(snaps.held_slots() + snaps._free) == list(
                range(spec.num_slots, spec.num_rows))
        released = kv.take_released()  # what the next step would release
        for rows in self.group_rows:
            rows.release(released)
            assert rows.num_kept == 0, rows.slot_of
            assert rows.num_free == len(rows.table)  # every row back for reuse

    # ------------------------------------------------------------------ checks
    def _check_output(self, out: SchedulerOutput, before, placeholders) -> None:
        sched, kv = self.sched, self.kv
        ps, config = kv.page_size, sched.config
        ids = [entry.request_id for entry in out.scheduled]
        assert len(ids) == len(set(ids))
        if sched.requests and not any(placeholders.values()):
            # progress: something runs, or a preemption makes room (or a step in flight
            # will end the requests)
            assert ids or out.preempted_request_ids, "an idle step with requests pending"
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(ids) <= sched.max_num_seqs and out.num_rows <= sched.max_num_seqs
        assert sum(r.fan_out for r in sched.running) <= sched.max_num_seqs
        # Running requests first, then swapped ones back in, then new ones.
        running_before, swapped_before, _ = before
        rank = [0 if rid in running_before else 1 if rid in swapped_before else 2 for rid in ids]
        assert rank == sorted(rank), (ids, before)
        if 2 in rank:
            assert not out.preempted_request_ids and not sched.swapped
        if out.preempted_request_ids:
            assert 1 not in rank
        running_ids = {r.request_id for r in sched.running}
        for entry in out.scheduled:
            request = sched.requests[entry.request_id]
            start, num_new = entry.start_pos, entry.num_new_tokens
            num_spec = entry.num_spec_tokens
            assert entry.request_id in running_ids and request.status == RequestStatus.RUNNING
            if num_spec:  # a decode token, then proposals the step verifies
                assert entry.token_ids[1:] == self.proposed[entry.request_id][:num_spec]
                assert num_new == 1 + num_spec and entry.num_samples == 1
                num_new = 1
            assert start + num_new == request.num_computed_tokens and num_new >= 1
            in_flight = placeholders.get(entry.request_id, 0)
            num_known = max(0, min(num_new, request.num_tokens - start))
            assert num_new - num_known <= in_flight <= 1
            assert entry.token_ids[:num_new] == (request.all_token_ids[start:start + num_known]
                                                 + [PLACEHOLDER] * (num_new - num_known))
            table = self.tables[id(out)][entry.request_id]
            assert table == [kv.page_ids(entry.request_id, g) for g in range(kv.num_groups)]
            assert entry.pages_from is not None and entry.num_pages == len(table[0])
            assert entry.page_ids == table[0][entry.pages_from:]
            for (pages_from, ids), group_table in zip(entry.group_pages, table[1:], strict=True):
                assert ids == group_table[pages_from:]
            for w, group_table in zip(kv.group_windows, table, strict=True):
                assert 0 not in group_table[max(0, start - w + 1) // ps if w else 0:]
                assert len(group_table) * ps >= start + num_new + num_spec
            assert entry.sampling_counter == request.num_output_tokens + in_flight
            assert request.num_output_placeholders == in_flight + bool(entry.num_samples)
            if start + num_new < request.num_tokens + in_flight:
                assert entry.num_samples == 0
                assert config.chunked, "without chunking a request's tokens run whole"
            else:
                fan_out = request.fan_out if request.num_output_tokens == 0 else 1
                assert entry.num_samples == fan_out
            threshold = config.long_prefill_token_threshold
            if config.chunked and threshold:
                assert num_new <= threshold
        for rid in out.preempted_request_ids:
            assert rid not in ids and rid not in running_ids
        slots = [entry.state_slot for entry in out.scheduled]
        if kv.state_slots is None:
            assert set(slots) <= {0}
        else:
            assert slots == [kv.state_slot(e.request_id) for e in out.scheduled] and 0 not in slots
            assert len(set(slots)) == len(slots)
            for entry in out.scheduled:  # a verifying request's state is backed up first
                assert bool(entry.num_spec_tokens) == kv.state_slots.backups.holds(
                    entry.request_id)

    def _check_state(self) -> None:
        sched, kv = self.sched, self.kv
        queues = [*sched.running, *sched.waiting, *sched.swapped]
        assert len(queues) == len({r.request_id for r in queues}), "a request in two queues"
        assert {r.request_id for r in queues} == set(sched.requests)
        assert all(sched.requests[r.request_id] is r for r in queues)
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            assert kv.has_request(r.request_id) and not kv.is_swapped(r.request_id)
            for g, w in enumerate(kv.group_windows):
                ids = kv.page_ids(r.request_id, g)
                assert len(ids) * kv.page_size >= r.num_computed_tokens
                # A sliding group holds every page the next query's window reaches.
                first = max(0, r.num_computed_tokens - w + 1) // kv.page_size if w else 0
                assert 0 not in ids[first:r.num_computed_tokens // kv.page_size + 1]
            assert r.num_computed_tokens <= r.num_tokens_with_placeholders
            assert 0 <= r.num_output_placeholders <= 1 + self.overlap
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not kv.has_request(r.request_id) and r.num_computed_tokens == 0
        for r in sched.swapped:
            assert r.status == RequestStatus.SWAPPED and kv.is_swapped(r.request_id)
        on_device = {rid for rid in kv.tables.requests if not kv.is_swapped(rid)}
        assert on_device == {r.request_id for r in sched.running}
        assert {rid for rid in kv.tables.requests if kv.is_swapped(rid)} == {
            r.request_id for r in sched.swapped}
        # Every page's ref count is the number of block tables holding it.
        holders = Counter(pid for r in sched.running for g in range(kv.num_groups)
                          for pid in kv.page_ids(r.request_id, g) if pid)
        owned = {p.page_id: p.ref_cnt for p in kv.pool.pages if p.ref_cnt}
        assert holders == owned
        assert kv.pool.num_used_pages == len(owned)
        slots = [s for state in kv.tables.requests.values() for s in state.host_slot_ids or ()]
        assert len(slots) == len(set(slots))
        assert kv.host_pool.num_free_slots + len(slots) == kv.host_pool.num_slots
        if kv.state_slots is not None:
            self._check_state_slots()

    def _check_state_slots(self) -> None:
        """Each running request holds one device state slot, each swapped one a host slot
        only, no two the same; the free ones make up the rest."""
        sched, state = self.sched, self.kv.state_slots
        assert set(state.slot_of) == {r.request_id for r in sched.running}
        assert set(state.host_slot_of) == {r.request_id for r in sched.swapped}
        held, host_held = list(state.slot_of.values()), list(state.host_slot_of.values())
        assert len(set(held)) == len(held) and 0 not in held
        assert all(0 < s < state.num_request_slots for s in held)
        assert len(set(host_held)) == len(host_held)
        assert all(0 <= s < state.num_host_slots for s in host_held)
        assert state.num_free_slots + len(held) == state.num_request_slots - 1
        # Backups: only running requests' (a verify step's, until its update), each its own.
        backups = state.backups.backup_of
        assert set(backups) <= set(state.slot_of)
        assert len(set(backups.values())) == len(backups)
        assert all(state.num_request_slots <= s < state.num_slots for s in backups.values())
        assert state.backups.num_free + len(backups) == state.backups.num_slots
        assert state.num_free_host_slots + len(host_held) == state.num_host_slots

    def _run(self, out: SchedulerOutput) -> None:
        """Executes the plans, writes the step's KV, then checks what attention reads."""
        ps, plans = self.kv.page_size, out.plans
        for page, slot in plans.swap_out.pairs:  # a page never written holds garbage
            self.host[slot] = list(self.device.get(page, [None] * ps))
        for slot, page in plans.swap_in.pairs:
            self.device[page] = list(self.host[slot])
        copies = [(dst, list(self.device[src])) for src, dst in plans.copy.pairs]
        for dst, content in copies:
            self.device[dst] = content
        self._run_state_plans(plans.state)
        fingerprints, tables = {}, self._kept_tables(out)
        del self.tables[id(out)]
        for entry in out.scheduled:
            tokens = self.seen[entry.request_id].all_token_ids
            if entry.num_spec_tokens:  # proposals: KV of tokens the request may never have
                tokens = tokens[:entry.start_pos + 1] + entry.token_ids[1:]
            fps = prefix_fingerprints(tokens)
            fingerprints[entry.request_id] = fps
            for table in tables[entry.request_id]:
                for pos in range(entry.start_pos, entry.start_pos + entry.num_new_tokens):
                    assert table[pos // ps], f"{entry.request_id} writes into the null page"
                    page = self.device.setdefault(table[pos // ps], [None] * ps)
                    page[pos % ps] = fps[pos]
        if self.kv.state_slots is not None:
            for entry in out.scheduled:  # the step's state reads, then its writes
                fps, start = fingerprints[entry.request_id], entry.start_pos
                if start:  # a step from position 0 starts the state from zero
                    assert self.state_device.get(entry.state_slot) == fps[start - 1], (
                        f"{entry.request_id} reads a wrong state (slot {entry.state_slot})")
            for entry in out.scheduled:
                end = entry.start_pos + entry.num_new_tokens
                self.state_device[entry.state_slot] = fingerprints[entry.request_id][end - 1]
        for entry in out.scheduled:
            fps = fingerprints[entry.request_id]
            for g, table in enumerate(tables[entry.request_id]):
                # What the step's first query reads: a sliding group only its window.
                w = self.kv.group_windows[g]
                first = max(0, entry.start_pos - w + 1) if w else 0
                for pos in range(first, entry.start_pos + entry.num_new_tokens):
                    page = table[pos // ps]
                    assert self.device[page][pos % ps] == fps[pos], (
                        f"{entry.request_id} reads wrong KV at position {pos} (page {page}, "
                        f"group {g})")

    def _run_state_plans(self, plans) -> None:
        """A state group's moves in their order, each kind reading before it writes."""
        for slot, host in plans.swap_out.pairs:
            self.state_host[host] = self.state_device.get(slot)
        assert len({dst for _, dst in plans.copy.pairs}) == len(plans.copy.pairs)
        gathered = [self.state_device.get(src) for src, _ in plans.copy.pairs]
        for (_, dst), value in zip(plans.copy.pairs, gathered, strict=True):
            self.state_device[dst] = value
        assert len({dst for _, dst in plans.swap_in.pairs}) == len(plans.swap_in.pairs)
        for host, slot in plans.swap_in.pairs:
            self.state_device[slot] = self.state_host.get(host)


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    """The step as `{request_id: num_new_tokens}`."""
    return out.num_scheduled_tokens


def decode_until_preemption(h: Harness, max_steps: int = 50) -> SchedulerOutput:
    """Steps until a step preempts something; returns that step's output."""
    for _ in range(max_steps):
        out, _ = h.step()
        if out.preempted_request_ids:
            return out
    raise AssertionError("no preemption")

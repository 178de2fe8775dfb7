"""Continuous-batching scheduler: token budget, chunked prefill, prefix hits, preemption.

Each `schedule()` decides `{request_id: num_new_tokens}`: running requests first (a decode
token or the next prefill chunk), then swapped requests back in, then waiting ones. When
pages run out, the lowest-priority running request is preempted (recompute or swap); under
data-parallel attention, one on the attention rank that ran out.
`update_from_output()` then advances every request by what the step computed.
"""

from __future__ import annotations

from collections import deque

from jaxserve.config import SchedulerConfig
from jaxserve.core.adapter_limit import AdapterLimit
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.ranked_kv import RankedKVCacheManager
from jaxserve.core.request_checks import check_new_request
from jaxserve.core.scheduler_output import (
    PLACEHOLDER,
    ScheduledRequest,
    SchedulerOutput,
    StepDraft,
)
from jaxserve.core.scheduler_update import OutputUpdater
from jaxserve.multimodal.inputs import chunk_rope_positions, whole_images
from jaxserve.request import Request, RequestStatus
from jaxserve.utils import delegated


class Scheduler:
    """Host-side scheduler over one `KVCacheManager` (no JAX).

    Requests carry `sampling_params` (max_tokens, stop ids, n, ...), `priority` and
    `eos_token_ids` attributes, set by the engine.

    Args:
        config: Scheduler settings.
        kv: The KV cache manager (page allocation, prefix cache, swap); under data-parallel
            attention a `RankedKVCacheManager`, whose ranks the entries' `rank` names.
        max_model_len: Longest prompt + output.
        max_num_batched_tokens: Token budget of a step (already resolved).
        max_loras: Most distinct LoRA adapters among the running requests (the device's
            adapter slots): a waiting request whose adapter would be one too many waits,
            and the ones behind it may go first (vLLM's rule). None: no adapters.
    """

    MODES = ("continuous+chunked", "continuous")  # the `scheduling_mode`s it serves

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | RankedKVCacheManager,
                 max_model_len: int, max_num_batched_tokens: int, max_loras: int | None = None):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        if config.scheduling_mode not in self.MODES:
            raise ValueError(f"scheduling_mode={config.scheduling_mode!r} is not "
                             f"{type(self).__name__}'s ({', '.join(self.MODES)}); build the "
                             "scheduler with jaxserve.core.baseline_schedulers."
                             "scheduler_class(scheduling_mode)")
        self.max_num_seqs = config.max_num_seqs
        if kv.state_slots is not None and kv.state_slots.num_request_slots - 1 < self.max_num_seqs:
            # NOTE: fan-out children fork when their samples come back and cannot wait.
            raise ValueError(f"the KV manager's state group has {kv.state_slots.num_request_slots}"
                             " slots (num_slots, the null slot included, less num_backup_slots);"
                             f" max_num_seqs={self.max_num_seqs} needs {self.max_num_seqs + 1}")
        self.adapters = AdapterLimit(max_loras)
        # Most tokens one request may hold in KV: what the pool gives a request running
        # alone (past the admission watermark) and, without chunking, what one step computes.
        # NOTE: a request reaching it ends as length-capped, like at max_model_len; were it
        # to grow on, no preemption could make room (allocation would raise), and a request
        # over the watermark or the budget could never be swapped in or recomputed again.
        self.max_kv_tokens = kv.max_tokens_per_request
        if not config.chunked:
            self.max_kv_tokens = min(self.max_kv_tokens, max_num_batched_tokens)
        # Tokens (prompt + outputs) at which a request ends as length-capped.
        self.length_cap = min(max_model_len, self.max_kv_tokens + 1)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.updater = OutputUpdater(self)

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request, kv_from: Request | None = None) -> None:
        """Queues a request, or raises if it can never run.

        A request whose tokens outgrow the pool (`max_kv_tokens`) later ends as
        length-capped, as at `max_model_len`.

        Args:
            request: A new request (nothing computed).
            kv_from: A live request to start from (`LLMEngine.fork_request`): the leading
                tokens the two have alike, as far as `kv_from` has computed them, are not
                computed again; `request` takes `kv_from`'s pages for them
                (`KVCacheManager.fork`; a shared page is copied before a write into it) and
                runs from now on. Where nothing can be shared (`kv_from` holds no device
                pages, a sliding window's pages are gone: `KVCacheManager.can_fork`) or no
                sequence slot is free, it waits as any new request does.

        Raises:
            ValueError: Duplicate id, prompt longer than `max_model_len`, more pages than
                the pool holds (less the watermark), without chunked prefill more tokens
                than `max_num_batched_tokens`, or more samples than `max_num_seqs`.
        """
        check_new_request(self, request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if kv_from is None or not self._start_from(request, kv_from):
            self._enqueue_waiting(request)

    def _start_from(self, request: Request, parent: Request) -> bool:
        """Starts a new request running on `parent`'s KV for the computed tokens they begin
        with alike (its last token is left to compute: its logits are needed); False, with
        nothing done, when nothing can be shared or no sequence slot is free."""
        if (self.requests.get(parent.request_id) is not parent
                or self._num_slots() + request.fan_out > self.max_num_seqs):
            return False
        limit = min(parent.num_computed_tokens, request.num_tokens - 1)
        mine, theirs = request.all_token_ids, parent.all_token_ids
        num_shared = next((i for i in range(limit) if mine[i] != theirs[i]), limit)
        if not num_shared or not self.kv.can_fork(parent, num_shared):
            return False
        request.num_computed_tokens = request.num_cached_tokens = num_shared
        self.kv.fork(parent, request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _enqueue_waiting(self, request: Request, front: bool = False) -> None:
        if self.config.scheduling_policy == "priority":
            key = (request.priority, request.arrival_time)
            index = next((i for i, r in enumerate(self.waiting)
                          if (r.priority, r.arrival_time) > key), len(self.waiting))
            self.waiting.insert(index, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (abort, stop string, error) and frees its pages; None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        if self.kv.has_request(request_id):  # device pages or host slots
            self.kv.free(request)
        request.status = status
        return request

    def fork(self, parent: Request, child_id: str, index: int | None = None) -> Request:
        """Forks a running request: the child has the parent's tokens and shares its pages
        (a partly filled page is copied on the first write into it), and runs from now on.

        Args:
            parent: A running request whose KV is computed up to its last token.
            child_id: The child's request id (unused so far).
            index: Where the child goes in the running queue (default: last).

        Raises:
            ValueError: `child_id` is in use.
        """
        if child_id in self.requests:
            raise ValueError(f"request id {child_id!r} is already in use")
        child = parent.fork(child_id)
        self.kv.fork(parent, child)
        self.requests[child_id] = child
        self.running.insert(len(self.running) if index is None else index, child)
        return child

    def set_proposals(self, proposals: dict[str, list[int]]) -> None:
        """Proposed next tokens of running requests (speculative decoding), taken by the
        next `schedule()` as far as budget and length allow; unknown ids are ignored."""
        for request_id, token_ids in proposals.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.spec_token_ids = list(token_ids)

    def _num_slots(self) -> int:
        """Sequence slots in use: a request that will fan out into n samples holds n."""
        return sum(r.fan_out for r in self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    scheduled_request = delegated("updater", OutputUpdater.scheduled_request)
    unschedule = delegated("updater", OutputUpdater.unschedule)
    update_from_output = delegated("updater", OutputUpdater.update_from_output)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Builds the next step (see the module docstring)."""
        out = SchedulerOutput()
        step = StepDraft(self.max_num_batched_tokens)
        self._schedule_running(step, out)
        if not out.preempted_request_ids:
            self._resume_swapped(step)
        if not out.preempted_request_ids and not self.swapped:
            self._admit_waiting(step)
        out.scheduled = list(step.entries.values())
        # NOTE: progress is taken at schedule time, not when the step's output comes back,
        # so the next step can be scheduled while this one runs (async scheduling); a
        # sampled token still in flight is a placeholder until `update_from_output`.
        for entry in out.scheduled:
            request = out.requests[entry.request_id] = self.requests[entry.request_id]
            # NOTE: proposals count once accepted (`update_from_output`).
            request.num_computed_tokens += entry.num_new_tokens - entry.num_spec_tokens
            request.spec_token_ids = []
            if entry.num_samples:
                request.num_output_placeholders += 1
        out.plans = self.kv.take_plans()
        out.released_request_ids = self.kv.take_released()
        return out

    def _schedule_running(self, step: StepDraft, out: SchedulerOutput) -> None:
        """Running requests in order, preempting from the back when pages run out."""
        index = 0
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            num_new = (0 if self._ends_in_flight(request)
                       else self._num_new_tokens(request, step.budget))
            if num_new == 0:
                index += 1
                continue
            num_spec = self._num_spec(request, num_new, step.budget)
            if num_spec and self.kv.allocate_slots(request, num_new,
                                                   num_lookahead_tokens=num_spec) is None:
                num_spec = 0  # no room for proposals: never preempt anyone for them
            elif num_spec:
                if self.kv.state_slots is not None:  # the state goes past rejected proposals
                    self.kv.state_slots.back_up(request.request_id)
                step.add(self._entry(request, num_new, num_spec))
                index += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim(request)
                if step.drop(victim.request_id):
                    index -= 1
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                step.add(self._entry(request, num_new))
                index += 1

    def _num_new_tokens(self, request: Request, budget: int, num_cached: int = 0) -> int:
        """Tokens to compute this step past `num_cached` prefix-hit ones (0: none fit)."""
        num_new = request.num_tokens_with_placeholders - request.num_computed_tokens - num_cached
        if self.config.chunked:
            threshold = self.config.long_prefill_token_threshold
            if threshold:
                num_new = min(num_new, threshold)
            num_new, snapshots = min(num_new, budget), self.kv.snapshots
            if request.mm_items:
                num_new = whole_images(request, request.num_computed_tokens + num_cached,
                                       num_new)
            # NOTE: a hybrid's chunks end on page boundaries, where its state is kept.
            return num_new if snapshots is None else snapshots.align_chunk(request, num_new,
                                                                           num_cached)
        return num_new if num_new <= budget else 0

    def _num_spec(self, request: Request, num_new: int, budget: int) -> int:
        """Proposals a decoding request verifies this step: its `spec_token_ids`, as many
        as the budget and its limits allow (the accepted ones and a bonus token must not
        pass max_tokens or the length cap)."""
        if not request.spec_token_ids or num_new != 1 or not request.decodes_next:
            return 0
        slots = self.kv.state_slots
        if slots is not None and not slots.can_back_up(request.request_id):
            return 0  # NOTE: no backup slot free: its state could not go back past a rejection
        room = self.length_cap - request.num_tokens
        sp = request.sampling_params
        if sp.max_tokens is not None:
            room = min(room, sp.max_tokens - request.num_output_tokens)
        return max(0, min(len(request.spec_token_ids), budget - 1, room - 1))

    def _num_samples(self, request: Request, num_new: int) -> int:
        if request.num_computed_tokens + num_new < request.num_tokens_with_placeholders:
            return 0  # a prompt chunk short of the end: nothing to sample
        return request.fan_out if request.num_output_tokens == 0 else 1

    def _entry(self, request: Request, num_new: int, num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start:start + num_new]
        token_ids += [PLACEHOLDER] * (num_new - len(token_ids))
        (pages_from, page_ids), *group_pages = self.kv.page_deltas(request.request_id)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids + request.spec_token_ids[:num_spec] if num_spec else token_ids,
            start_pos=start,
            page_ids=page_ids,
            num_samples=self._num_samples(request, num_new),
            sampling_counter=request.num_output_tokens + request.num_output_placeholders,
            num_spec_tokens=num_spec,
            pages_from=pages_from,
            group_pages=tuple(group_pages),
            lora_id=request.lora_id,
            state_slot=self.kv.state_slot(request.request_id),
            rank=self.kv.rank_of(request.request_id),
            mm_items=tuple(item for item in request.mm_items
                           if item.offset < start + num_new and item.end > start),
            rope_positions=chunk_rope_positions(request, start, num_new + num_spec))

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether a token in flight surely ends the request (its length limits): it is
        not scheduled again, since that step could only compute past its end."""
        if not request.num_output_placeholders:
            return False
        sp = request.sampling_params
        num_out = request.num_output_tokens + request.num_output_placeholders
        return ((sp.max_tokens is not None and num_out >= sp.max_tokens)
                or request.num_tokens_with_placeholders >= self.length_cap)

    def _pick_victim(self, request: Request) -> Request:
        """The running request to preempt so that `request` gets pages: one on its attention
        rank (freeing another rank's pages does not help), `request` itself at worst."""
        running = self.running
        if self.kv.num_ranks > 1:
            rank = self.kv.rank_of(request.request_id)
            running = [r for r in running if self.kv.rank_of(r.request_id) == rank]
        if self.config.scheduling_policy == "priority":
            # NOTE: reversed, so that among equal keys (fan-out siblings) the most recently
            # admitted goes, as under fcfs.
            return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))
        return running[-1]  # the most recently admitted

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        out.preempted_request_ids.append(request.request_id)
        if self.config.preemption_mode == "swap" and self.kv.swap_out(request) is not None:
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        self.kv.free(request)  # recompute: start again from the prompt plus outputs
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self._enqueue_waiting(request, front=True)

    def _resume_swapped(self, step: StepDraft) -> None:
        adapters = self.adapters.running(self.running)
        while self.swapped and step.budget > 0 and self._num_slots() < self.max_num_seqs:
            request = self.swapped[0]
            if self._num_slots() + request.fan_out > self.max_num_seqs:
                break  # NOTE: its samples would fork past max_num_seqs
            num_new = self._num_new_tokens(request, step.budget)
            # NOTE: the pages for this step's tokens must be free as well; a request swapped
            # in without them would not run and would be swapped straight back out.
            if (num_new == 0 or not self.adapters.fits(request, adapters)
                    or not self.kv.can_swap_in(request, num_new)):
                break
            self.kv.swap_in(request)
            self.swapped.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.adapters.note(request, adapters)
            if self.kv.allocate_slots(request, num_new) is None:
                break  # back in device pages; it runs (or is preempted) next step
            step.add(self._entry(request, num_new))

    def may_admit(self) -> bool:
        """Whether this step may admit waiting requests once running and swapped ones are
        served: always, under continuous batching. The benchmarks' baselines hold them
        back (static batching: `jaxserve.core.baseline_schedulers`)."""
        return True

    def _admit_waiting(self, step: StepDraft) -> None:
        if not self.may_admit():
            return
        skipped = 0  # waiting requests passed over: their adapter has no slot this step
        adapters = self.adapters.running(self.running)
        while (len(self.waiting) > skipped and step.budget > 0
               and self._num_slots() < self.max_num_seqs):
            request = self.waiting[skipped]
            if not self.adapters.fits(request, adapters):
                skipped += 1
                continue
            hit_ids, num_hit = self._prefix_hit(request)
            num_new = self._num_new_tokens(request, step.budget, num_hit)
            if num_new == 0:
                break
            fan_out = request.fan_out if request.num_output_tokens == 0 else 1
            if self._num_slots() + fan_out > self.max_num_seqs and self.running:
                break
            if self.kv.allocate_slots(request, num_new, num_hit, hit_ids) is None:
                break
            del self.waiting[skipped]
            request.num_computed_tokens += num_hit
            request.num_cached_tokens = max(request.num_cached_tokens, num_hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.adapters.note(request, adapters)
            step.add(self._entry(request, num_new))

    def _prefix_hit(self, request: Request) -> tuple[list[int], int]:
        """Cached pages for a waiting request's prompt: (page ids, tokens they hold)."""
        sp = request.sampling_params
        # NOTE: prompt logprobs need every prompt position computed: no prefix hits.
        if self.kv.has_request(request.request_id) or sp.prompt_logprobs is not None:
            return [], 0
        return self.kv.get_computed_pages(request)

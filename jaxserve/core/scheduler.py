"""Continuous-batching scheduler: token budget, chunked prefill, prefix hits, preemption.

Each `schedule()` decides `{request_id: num_new_tokens}`: running requests first (a decode
token or the next prefill chunk), then swapped requests back in, then waiting ones. When
pages run out, the lowest-priority running request is preempted (recompute or swap).
`update_from_output()` then advances every request by what the step computed.
"""

from __future__ import annotations

from collections import deque

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.core.stop_checker import check_stop
from jaxserve.request import Request, RequestStatus


class Scheduler:
    """Host-side scheduler over one `KVCacheManager` (no JAX).

    Requests carry `sampling_params` (max_tokens, stop ids, n, ...), `priority` and
    `eos_token_ids` attributes, set by the engine.

    Args:
        config: Scheduler settings.
        kv: The KV cache manager (page allocation, prefix cache, swap).
        max_model_len: Longest prompt + output.
        max_num_batched_tokens: Token budget of a step (already resolved).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 max_num_batched_tokens: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = 1 if config.scheduling_mode == "naive" else config.max_num_seqs
        # Most tokens one request may hold in KV: what the pool gives a request running
        # alone (past the admission watermark) and, without chunking, what one step computes.
        # NOTE: a request reaching it ends as length-capped, like at max_model_len; were it
        # to grow on, no preemption could make room (allocation would raise), and a request
        # over the watermark or the budget could never be swapped in or recomputed again.
        self.max_kv_tokens = (kv.pool.num_usable_pages - kv.watermark_pages) * kv.page_size
        if not config.chunked:
            self.max_kv_tokens = min(self.max_kv_tokens, max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._batch_open = True  # static mode: whether the current batch still admits

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queues a request, or raises if it can never run.

        A request whose tokens outgrow the pool (`max_kv_tokens`) later ends as
        length-capped, as at `max_model_len`.

        Raises:
            ValueError: Duplicate id, prompt longer than `max_model_len`, more pages than
                the pool holds (less the watermark), without chunked prefill more tokens
                than `max_num_batched_tokens`, or more samples than `max_num_seqs`.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt of request {request.request_id!r} has "
                             f"{request.num_prompt_tokens} tokens, more than max_model_len "
                             f"{self.max_model_len}")
        if request.fan_out > self.max_num_seqs:
            raise ValueError(f"request {request.request_id!r} fans out into {request.fan_out} "
                             f"samples, more than max_num_seqs {self.max_num_seqs}")
        if request.num_prompt_tokens > self.max_kv_tokens:
            kv, budget = self.kv, self.max_num_batched_tokens
            if request.num_prompt_tokens > budget and not self.config.chunked:
                raise ValueError(f"prompt of request {request.request_id!r} has "
                                 f"{request.num_prompt_tokens} tokens, more than "
                                 f"max_num_batched_tokens {budget} without chunked prefill")
            pages = -(-request.num_prompt_tokens // kv.page_size)
            raise ValueError(f"request {request.request_id!r} needs {pages} KV pages; the "
                             f"pool has only {kv.pool.num_usable_pages} (watermark "
                             f"{kv.watermark_pages})")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

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
        if self.kv.has_request(request_id) or self.kv.is_swapped(request_id):
            self.kv.free(request)
        request.status = status
        return request

    def _num_slots(self) -> int:
        """Sequence slots in use: a request that will fan out into n samples holds n."""
        return sum(r.fan_out for r in self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Builds the next step (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        rows = 0
        scheduled: dict[str, ScheduledRequest] = {}

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                index += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id).num_new_tokens
                    rows = sum(max(1, s.num_samples) for s in scheduled.values())
                    index -= 1
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                entry = self._entry(request, num_new)
                scheduled[request.request_id] = entry
                budget -= num_new
                rows += max(1, entry.num_samples)
                index += 1

        if not out.preempted_request_ids:
            budget, rows = self._resume_swapped(scheduled, budget, rows)
        if not out.preempted_request_ids and not self.swapped:
            self._admit_waiting(scheduled, budget, rows)

        out.scheduled = list(scheduled.values())
        out.plans = self.kv.take_plans()
        return out

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if self.config.chunked:
            threshold = self.config.long_prefill_token_threshold
            if threshold:
                num_new = min(num_new, threshold)
            return min(num_new, budget)
        return num_new if num_new <= budget else 0

    def _num_samples(self, request: Request, num_new: int) -> int:
        if request.num_computed_tokens + num_new < request.num_tokens:
            return 0  # a prompt chunk short of the end: nothing to sample
        return request.fan_out if request.num_output_tokens == 0 else 1

    def _entry(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + num_new],
            start_pos=start,
            block_ids=self.kv.block_ids(request.request_id),
            num_samples=self._num_samples(request, num_new),
            sampling_counter=request.num_output_tokens)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            # NOTE: reversed, so that among equal keys (fan-out siblings) the most recently
            # admitted goes, as under fcfs.
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]  # the most recently admitted

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

    def _resume_swapped(self, scheduled, budget: int, rows: int) -> tuple[int, int]:
        while self.swapped and budget > 0 and self._num_slots() < self.max_num_seqs:
            request = self.swapped[0]
            num_new = self._num_new_tokens(request, budget)
            # NOTE: the pages for this step's tokens must be free as well; a request swapped
            # in without them would not run and would be swapped straight back out.
            num_pages = -(-(request.num_computed_tokens + num_new) // self.kv.page_size)
            if (num_new == 0 or not self.kv.can_swap_in(request)
                    or num_pages > self.kv.num_allocatable_pages):
                break
            self.kv.swap_in(request)
            self.swapped.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if self.kv.allocate_slots(request, num_new) is None:
                break  # back in device pages; it runs (or is preempted) next step
            entry = self._entry(request, num_new)
            scheduled[request.request_id] = entry
            budget -= num_new
            rows += max(1, entry.num_samples)
        return budget, rows

    def _admit_waiting(self, scheduled, budget: int, rows: int) -> None:
        mode = self.config.scheduling_mode
        if mode in ("static", "naive"):
            if self.running:
                if not self._batch_open:
                    return
            else:
                self._batch_open = True
        while self.waiting and budget > 0 and self._num_slots() < self.max_num_seqs:
            request = self.waiting[0]
            hit_ids, num_hit = ([], 0)
            sp = request.sampling_params
            # NOTE: prompt logprobs need every prompt position computed: no prefix hits.
            if not self.kv.has_request(request.request_id) and (
                    sp is None or sp.prompt_logprobs is None):
                hit_ids, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - num_hit
            if not self.config.chunked and num_new > budget:
                break
            if self.config.chunked and self.config.long_prefill_token_threshold:
                num_new = min(num_new, self.config.long_prefill_token_threshold)
            num_new = min(num_new, budget)
            fan_out = request.fan_out if request.num_output_tokens == 0 else 1
            if self._num_slots() + fan_out > self.max_num_seqs and self.running:
                break
            if self.kv.allocate_slots(request, num_new, num_hit, hit_ids) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens += num_hit
            request.num_cached_tokens = max(request.num_cached_tokens, num_hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            entry = self._entry(request, num_new)
            scheduled[request.request_id] = entry
            budget -= num_new
            rows += max(1, entry.num_samples)
        if mode in ("static", "naive") and self.running:
            self._batch_open = False

    # ------------------------------------------------------------- update
    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Advances requests by what the step computed and appends sampled tokens.

        Fan-out requests (n > 1) fork here, after the step wrote their prompt's KV: each
        child shares the parent's pages (copy-on-write) and takes one of the samples.

        Args:
            out: The step's scheduler output.
            sampled: `{request_id: token ids}` for requests with `num_samples > 0`.

        Returns:
            (request, new token ids) for every request that got tokens, children included;
            finished ones have a finished status and no pages any more.
        """
        results: list[tuple[Request, list[int]]] = []
        for entry in out.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            request.num_computed_tokens += entry.num_new_tokens
            tokens = sampled.get(entry.request_id, [])
            if not tokens:
                continue
            results.append((request, tokens[:1]))
            for i, token in enumerate(tokens[1:], start=1):
                child_id = f"{request.request_id}#{i}"
                while child_id in self.requests:  # NOTE: a user id may look like a child's
                    child_id += "#"
                child = request.fork(child_id)
                child.sample_index = i
                child.forked_from = request.request_id
                self.kv.fork(request, child)
                self.requests[child.request_id] = child
                self.running.insert(self.running.index(request) + i, child)
                results.append((child, [token]))
            request.fan_out = 1
        for request, tokens in results:
            request.append_output_token_ids(tokens)
            self._check_stop(request)
        return results

    def _check_stop(self, request: Request) -> None:
        sp = request.sampling_params
        reason = check_stop(
            request.output_token_ids, num_prompt_tokens=request.num_prompt_tokens,
            max_tokens=sp.max_tokens,
            max_model_len=min(self.max_model_len, self.max_kv_tokens + 1),
            eos_token_ids=request.eos_token_ids, ignore_eos=sp.ignore_eos,
            stop_token_ids=sp.stop_token_ids or (), min_tokens=sp.min_tokens)
        if reason is None:
            return
        kind, stop_reason = reason
        request.stop_reason = stop_reason
        self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED if kind == "stop"
                            else RequestStatus.FINISHED_LENGTH_CAPPED)

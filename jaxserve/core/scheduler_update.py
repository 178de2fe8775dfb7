"""`OutputUpdater`: what a scheduler does after a step: advancing requests by what the step
computed (fan-out forks, verified proposals, stop checks), or taking back a step that never
ran."""

from __future__ import annotations

from typing import Protocol

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.core.stop_checker import check_stop
from jaxserve.request import Request, RequestStatus


class UpdatedScheduler(Protocol):
    """What `OutputUpdater` reads and calls of its scheduler (`Scheduler` provides it)."""

    requests: dict[str, Request]
    running: list[Request]
    kv: KVCacheManager
    length_cap: int

    def fork(self, parent: Request, child_id: str, index: int | None = None) -> Request:
        """Forks a running request (fan-out); the child runs at `index`."""

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request and frees its pages."""


class OutputUpdater:
    """Advances a scheduler's requests by a step's samples, or takes back a step that never
    ran (`Scheduler.update_from_output`, `unschedule` and `scheduled_request` delegate
    here).

    Args:
        scheduler: The scheduler it updates, through the members `UpdatedScheduler` names.
    """

    def __init__(self, scheduler: UpdatedScheduler):
        self.scheduler = scheduler

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
        sched = self.scheduler
        results: list[tuple[Request, list[int]]] = []
        verified: list[tuple[Request, ScheduledRequest]] = []  # requests that verified
        for entry in out.scheduled:
            request = self.scheduled_request(out, entry.request_id)
            if request is None or request.is_finished():
                continue  # finished meanwhile (its pages are gone)
            if entry.num_samples:
                request.num_output_placeholders -= 1
            # NOTE: a request preempted since this step was scheduled (async scheduling)
            # still takes its token: recompute restarts from the prompt plus outputs.
            tokens = sampled.get(entry.request_id, [])
            if not tokens:
                if entry.num_spec_tokens:  # NOTE: no verdict, yet the state took every proposal
                    self.settle_state(request, entry)
                continue
            if entry.num_spec_tokens:
                # Accepted proposals and the token after them: their KV is computed.
                tokens = tokens[:entry.num_spec_tokens + 1]
                request.num_computed_tokens += len(tokens) - 1
                results.append((request, tokens))
                verified.append((request, entry))
                continue
            results.append((request, tokens[:1]))
            for i, token in enumerate(tokens[1:], start=1):
                child_id = f"{request.request_id}#{i}"
                while child_id in sched.requests:  # NOTE: a user id may look like a child's
                    child_id += "#"
                child = sched.fork(request, child_id, sched.running.index(request) + i)
                child.sample_index = i
                child.forked_from = request.request_id
                results.append((child, [token]))
            request.fan_out = 1
        kept = []
        for request, tokens in results:
            for i, token in enumerate(tokens):  # NOTE: a stop ends verified tokens there
                request.append_output_token_ids(token)
                self.check_stop(request)
                if request.is_finished():
                    tokens = tokens[:i + 1]
                    break
            kept.append((request, tokens))
        for request, entry in verified:  # pages only rejected proposals were written into
            if not request.is_finished():
                sched.kv.trim(request)
                self.settle_state(request, entry)
        return kept

    def settle_state(self, request: Request, entry: ScheduledRequest) -> None:
        """After a verify step, a state group's backup of `request`: dropped when every
        proposal held (the state is the request's), else read back, and the request's
        progress taken back to before the step (`entry.start_pos`), so its next step
        recomputes the tokens the state must take in: the step's first token, the accepted
        proposals and the new one. Their K/V is rewritten as computed (same tokens, same
        positions); the tokens themselves and the step's counts stand."""
        slots = self.scheduler.kv.state_slots
        if slots is None or not slots.backups.holds(request.request_id):
            return  # NOTE: no state group, or preempted since (its backup went with it)
        num_accepted = request.num_computed_tokens - entry.start_pos - 1
        if num_accepted == entry.num_spec_tokens:
            slots.drop_backup(request.request_id)
        elif slots.restore_backup(request.request_id):
            request.num_computed_tokens = entry.start_pos

    def check_stop(self, request: Request) -> None:
        """Finishes `request` (stopped or length-capped) if its newest token ends it."""
        sp = request.sampling_params
        reason = check_stop(
            request.output_token_ids, num_prompt_tokens=request.num_prompt_tokens,
            max_tokens=sp.max_tokens,
            max_model_len=self.scheduler.length_cap,
            eos_token_ids=request.eos_token_ids, ignore_eos=sp.ignore_eos,
            stop_token_ids=sp.stop_token_ids or (), min_tokens=sp.min_tokens)
        if reason is None:
            return
        kind, stop_reason = reason
        request.stop_reason = stop_reason
        self.scheduler.finish_request(
            request.request_id, RequestStatus.FINISHED_STOPPED if kind == "stop"
            else RequestStatus.FINISHED_LENGTH_CAPPED)

    def unschedule(self, out: SchedulerOutput) -> None:
        """Takes back the progress `schedule()` gave a step that never ran (its dispatch
        failed): its requests compute those tokens again in a later step."""
        for entry in out.scheduled:
            request = self.scheduled_request(out, entry.request_id)
            if request is not None and not request.is_finished():
                request.num_computed_tokens -= entry.num_new_tokens - entry.num_spec_tokens
                request.num_output_placeholders -= bool(entry.num_samples)
                if entry.num_spec_tokens and self.scheduler.kv.state_slots is not None:
                    self.scheduler.kv.state_slots.drop_backup(entry.request_id)  # state unchanged
                # NOTE: the runner may have kept part of this step's table deltas.
                self.scheduler.kv.resend_pages(entry.request_id)

    def scheduled_request(self, out: SchedulerOutput, request_id: str) -> Request | None:
        """The request `out` scheduled as `request_id` if it is still in the scheduler, else
        None: it ended since, and its id may now belong to a new request (added after an
        abort while the step was in flight), which the step must not touch."""
        request = self.scheduler.requests.get(request_id)
        scheduled = out.requests.get(request_id, request)
        return request if request is scheduled else None

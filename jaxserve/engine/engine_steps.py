"""How an `LLMEngine` steps: schedule, hand the step to the device, and (with async
scheduling) schedule the next one before the first one's samples are back; then advance
the scheduler, the speculator and the outputs by what it sampled."""

from __future__ import annotations

import dataclasses

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.engine.output_processor import CoreStep
from jaxserve.outputs import RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.step_io import PendingStep


@dataclasses.dataclass
class InFlight:
    """A step handed to the device whose samples the host has not seen yet."""

    out: SchedulerOutput
    requests: dict[str, Request]
    pending: PendingStep
    failed: dict[str, BaseException]


class EngineSteps:
    """The stepping half of `LLMEngine` (which holds the scheduler, runner, speculator,
    input and output processors this reads)."""

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of requests it advanced.

        With async scheduling (the default) the next step is scheduled and handed to the
        device before this one's sampled ids are brought back, so the host's update, stop
        checks and detokenizing run while the device computes; the outputs returned are
        those of the step that was dispatched by the previous call (or by this one, when
        nothing could overlap it). A failure in one request's own host work ends that
        request only (finish_reason "error"); only a failure of the shared device step
        raises.
        """
        outputs, self._stashed = self._stashed, []
        if self._pending is None:
            self._pending = self._dispatch()
            if self._pending is None:
                return outputs
        following = self._dispatch(self._pending) if self._can_overlap(self._pending) else None
        pending, self._pending = self._pending, following
        return outputs + self._finish(pending)

    def flush(self) -> None:
        """Finishes the step in flight, if any (its outputs come with the next `step()`)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._stashed.extend(self._finish(pending))

    def _can_overlap(self, inflight: InFlight) -> bool:
        """Whether the next step may be scheduled before `inflight`'s samples are known:
        no request forks on them (n > 1), none waits for prompt logprobs from it, no
        running request's sampling reads its previous tokens (penalties, bad words), and
        no proposals are being made (speculative decoding, unless its gate pauses it)."""
        if not self.async_scheduling:
            return False
        # NOTE: proposals are made from each request's latest tokens, which an overlapped
        # step would not know yet: speculation steps one at a time (unless paused).
        if self.speculator is not None and self.speculator.active:
            return False
        # NOTE: a step verifying proposals yields an unknown number of tokens per request;
        # nothing can be scheduled on top of it.
        if inflight.pending.prompt_logprobs is not None or any(
                s.num_samples > 1 or s.num_spec_tokens for s in inflight.out.scheduled):
            return False
        if any(r.sampling_params.needs_output_history for r in self.scheduler.running):
            return False
        # NOTE: a constrained request's mask follows its previous token, also when it
        # comes back from preemption (not in `running` yet).
        return not (self.inputs.grammars.num_compiled
                    and any(r.grammar is not None for r in self.scheduler.requests.values()))

    def _dispatch(self, prev: InFlight | None = None) -> InFlight | None:
        """Schedules a step and hands it to the device; None when nothing was scheduled."""
        if self.speculator is not None:
            self.scheduler.set_proposals(self.speculator.step(self.scheduler.running))
        out = self.scheduler.schedule().decodes_first()
        if out.is_empty:
            # NOTE: a pass may schedule nothing yet plan moves (a swap-out that made room
            # for a swap-in that still does not fit): run them now, or the host slots the
            # scheduler counts as written would never be.
            self.runner.apply_kv_changes(out)
            return None
        reached_runner = False
        try:
            requests = {s.request_id: self.scheduler.requests[s.request_id]
                        for s in out.scheduled}
            sampling, failed = self.sampling_inputs.build(out, requests)
            reached_runner = True
            pending = self.runner.dispatch(out, sampling,
                                           prev=None if prev is None else prev.pending)
        except BaseException:
            if not reached_runner:
                self.runner.apply_kv_changes(out)  # the device must agree, step or none
            self.scheduler.unschedule(out)
            raise
        return InFlight(out, requests, pending, failed)

    def _core(self, inflight: InFlight) -> CoreStep:
        """Waits for a dispatched step and advances the scheduler by what it sampled."""
        result = self.runner.fetch(inflight.pending)
        out, requests = inflight.out, inflight.requests
        if result.prompt_logprobs is not None:
            self.outputs.record_prompt_logprobs(out, requests, result.prompt_logprobs)
        if result.routed_experts is not None:
            self.outputs.routing.record(out, requests, result.routed_experts)
        # NOTE: a request that ended while the step ran is skipped (its id may be reused).
        failed = {req_id: error for req_id, error in inflight.failed.items()
                  if self.scheduler.scheduled_request(out, req_id) is not None}
        for req_id in failed:  # before the update: it gets no token
            self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ERROR)
        sampled: dict[str, list[int]] = {}
        row_of: dict[str, list[int]] = {}
        for row, (req_id, token) in enumerate(zip(result.row_request_ids,
                                                  result.token_ids.tolist(), strict=True)):
            sampled.setdefault(req_id, []).append(token)
            row_of.setdefault(req_id, []).append(row)
        for s in out.scheduled:
            if s.num_spec_tokens and s.request_id in sampled and s.request_id not in failed:
                sampled[s.request_id] = self.speculator.verify(s.spec_token_ids,
                                                               sampled[s.request_id])
        if self.pooler is not None and result.pooled is not None:
            self.pooler.accumulate(out, result.pooled, skip=failed)
        updates = self.scheduler.update_from_output(out, sampled)
        if self.speculator is not None:
            self.speculator.observe(out, requests, sampled, result.aux_hidden)
        return CoreStep(out, requests, result, updates, row_of, failed)

    def _finish(self, inflight: InFlight) -> list[RequestOutput]:
        core = self._core(inflight)
        self.counters["num_steps"] += 1
        done = self.outputs.process(core)
        self._finish_requests(done.to_finish)
        return done.outputs if self.pooler is None else self.pooler.outputs(done.outputs)


"""`SamplingInputs`: a scheduled step's sampling arrays, from the runner's kept rows, with the
requests whose rows could not be built."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.request import Request
from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.structured import row_bitmasks

if TYPE_CHECKING:
    from jaxserve.engine.output_processor import OutputProcessor
    from jaxserve.runner.model_runner import ModelRunner


class SamplingInputs:
    """Builds the sampling arrays of each step an engine dispatches.

    A failure in one request's own rows (its settings, its structured-output mask) fails
    that request only: its rows become inert greedy ones, so the step computes the others'
    tokens exactly as it would without it, and the request is reported in `failed`.

    Args:
        runner: The engine's `ModelRunner` (its kept `sampling_rows`, its `step_shape`).
        outputs: The engine's `OutputProcessor` (each request's `RequestState`: the
            settings its row is written from).
        vocab_size: V.
    """

    def __init__(self, runner: ModelRunner, outputs: OutputProcessor, vocab_size: int):
        self.runner = runner
        self.outputs = outputs
        self.vocab_size = vocab_size

    def build(self, out: SchedulerOutput, requests: dict[str, Request]
              ) -> tuple[SamplingMetadata, dict[str, BaseException]]:
        """(sampling arrays, `{request_id: error}`) of a step from the runner's kept rows:
        each request's settings are written once, when it joins; this step adds its
        counters, output tokens and structured-output masks.

        Args:
            out: The scheduled step.
            requests: Its scheduled requests by id.
        """
        now, failed, constrained, first = time.time(), {}, [], 0
        for s in out.scheduled:
            req, num = requests[s.request_id], s.num_samples + s.num_spec_tokens
            if num:
                try:
                    self.outputs.row_state(req, now)
                except Exception as e:  # noqa: BLE001 - this request fails, not the step
                    failed.setdefault(s.request_id, e)
                if req.grammar is not None and s.request_id not in failed:
                    constrained.append((first, req, s))
            first += num
        masks = row_bitmasks(constrained, self.vocab_size, failed) if constrained else None
        _, num_rows = self.runner.step_shape(out)
        sampling, row_failed = self.gather(out, num_rows, masks, failed)
        return sampling, {**failed, **row_failed}

    def gather(self, out: SchedulerOutput, num_rows: int, masks, failed
               ) -> tuple[SamplingMetadata, dict[str, BaseException]]:
        """The step's sampling arrays gathered from the runner's rows, and the requests whose
        rows cannot be written. Those and the requests in `failed` get inert rows.

        Args:
            out: The scheduled step.
            num_rows: Its sampling-row bucket.
            masks: `{row: i32[ceil(V / 32)]}` structured-output bitmasks, or None.
            failed: Requests that already failed this step.
        """
        states = self.outputs.states
        return self.runner.sampling_rows.gather(
            out, num_rows, lambda req: states[req.user_request_id].row_params, masks,
            inert=failed)

"""`SamplingInputs`: a scheduled step's sampling arrays, from the runner's kept rows or from
hand-made rows, with the requests whose rows could not be built."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.request import Request
from jaxserve.sample.metadata import RowSpec, SamplingMetadata, build_sampling_metadata
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import mask_rows, row_bitmasks

if TYPE_CHECKING:
    from jaxserve.engine.output_processor import OutputProcessor
    from jaxserve.runner.model_runner import ModelRunner

# The row that stands in for a request whose own row could not be built (it computes
# nothing another row reads).
INERT_ROW = RowSpec(SamplingParams(temperature=0.0), (), (), 0, 0)


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
        eos_token_ids: The engine's EOS ids (the first is banned below `min_tokens`).
    """

    def __init__(self, runner: ModelRunner, outputs: OutputProcessor, vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        self.runner = runner
        self.outputs = outputs
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None

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

    def from_rows(self, out: SchedulerOutput, requests: dict[str, Request], row_for
                  ) -> tuple[SamplingMetadata, dict[str, BaseException]]:
        """(sampling arrays, `{request_id: error}`) of a step from hand-made rows.

        Args:
            out: The scheduled step.
            requests: Its scheduled requests by id.
            row_for: `(request, scheduled entry, k) -> RowSpec` of the k-th sampling row
                of a scheduled request.
        """
        rows, row_owner, row_failed, constrained = [], [], {}, []
        for s in out.scheduled:
            req, first = requests[s.request_id], len(rows)
            for k in range(s.num_samples + s.num_spec_tokens):
                try:
                    rows.append(row_for(req, s, k))
                except Exception as e:  # noqa: BLE001 - this request fails, not the step
                    row_failed.setdefault(s.request_id, e)
                    rows.append(INERT_ROW)
                row_owner.append(s.request_id)
            if req.grammar is not None and len(rows) > first \
                    and s.request_id not in row_failed:
                constrained.append((first, req, s))
        if constrained:
            mask_rows(rows, constrained, self.vocab_size, INERT_ROW, row_failed)
        _, num_rows = self.runner.step_shape(out)
        sampling, failed = self._rows_metadata(rows, row_owner, num_rows)
        return sampling, {**row_failed, **failed}

    def _rows_metadata(self, rows: list[RowSpec], row_owner: list[str], num_rows: int):
        """The sampling arrays of hand-made rows, and `{request_id: error}` of requests
        whose rows could not be built (replaced by inert rows)."""
        eos, vocab = self.eos_token_id, self.vocab_size
        try:
            return build_sampling_metadata(rows, num_rows, vocab, eos_token_id=eos), {}
        except Exception:  # noqa: BLE001 - find the rows at fault, below
            pass
        failed: dict[str, BaseException] = {}
        for i, row in enumerate(rows):
            try:
                build_sampling_metadata([row], 1, vocab, eos_token_id=eos)
            except Exception as e:  # noqa: BLE001
                failed.setdefault(row_owner[i], e)
        rows = [INERT_ROW if owner in failed else row for row, owner in zip(rows, row_owner,
                                                                        strict=True)]
        return build_sampling_metadata(rows, num_rows, vocab, eos_token_id=eos), failed

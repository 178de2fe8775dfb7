"""How a `ModelRunner` runs a step: the plans, the packed inputs to the device, the model,
prompt-logprobs and sampler programs dispatched without waiting (`dispatch`, `launch`), and
the samples brought back (`fetch`); every compile inside a step counted."""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.runner import compile_counter
from jaxserve.runner.step_io import PendingStep, StepInputs, StepResult
from jaxserve.runner.step_programs import result_on_host
from jaxserve.sample.metadata import SamplingMetadata


class StepDispatch:
    """The step-running half of `ModelRunner` (which holds the state it reads: the pool,
    the weights, the programs, the kept block tables and sampling rows)."""

    def execute(self, out: SchedulerOutput, sampling: SamplingMetadata,
                variant: str | None = None) -> StepResult:
        """Runs one step (`dispatch`, then `fetch`): plans, model, sampler."""
        return self.fetch(self.dispatch(out, sampling, variant))

    def dispatch(self, out: SchedulerOutput, sampling: SamplingMetadata,
                 variant: str | None = None, prev: PendingStep | None = None) -> PendingStep:
        """Hands one step to the device and returns without waiting for it.

        Args:
            out: The scheduler's step.
            sampling: One row per sampling row, padded to `step_shape(out)[1]` rows
                (`sampling_rows.gather`, or built by hand).
            variant: Force a sampler variant (warm-up); default: the cheapest that fits.
            prev: The step before this one, when it has not been fetched yet: placeholder
                tokens take the ids it samples (on the device).

        Raises:
            ValueError: A placeholder token whose request sampled nothing in `prev`.
        """
        start = compile_counter.num_compilations()
        try:
            return self._dispatch(out, sampling, variant, prev)
        finally:
            self.num_compilations += compile_counter.num_compilations() - start

    def fetch(self, pending: PendingStep) -> StepResult:
        """Waits for a dispatched step and brings its samples to the host."""
        start = compile_counter.num_compilations()
        try:
            return result_on_host(pending)
        finally:
            self.num_compilations += compile_counter.num_compilations() - start

    def _dispatch(self, out: SchedulerOutput, sampling: SamplingMetadata,
                  variant: str | None, prev: PendingStep | None) -> PendingStep:
        self.apply_kv_changes(out)
        arrays, model_buf, model_layout, num_tokens, num_rows = self._model_inputs(out, prev)
        total = int(arrays.cu_q_lens[-1])  # the step's tokens
        # i32[total]: for prompt logprobs, the next prompt token of each position (-1 where
        # not wanted), from the prompts of the kept rows; None skips them.
        prompt_targets = self.sampling_rows.prompt_targets(out, arrays.cu_q_lens)
        targets, num_prompt_logprobs = None, 0
        if prompt_targets is not None:
            targets = np.zeros(num_tokens, np.int32)  # i32[num_tokens]; padding: any id
            targets[:len(prompt_targets)] = np.maximum(prompt_targets, 0)
            num_prompt_logprobs = self.sampling_rows.prompt_logprobs_width(out)
        inputs = StepInputs(model_layout, model_buf,
                            self.is_decode_step(out, num_tokens, num_rows), sampling, variant,
                            targets, num_prompt_logprobs)
        self._step_count += 1
        if self.channel is not None:
            self.channel.send("step", inputs, self._step_count,
                              None if prev is None else prev.step_id)
        res, next_ids, prompt_lp, pooled, routed, aux = self.launch(
            inputs, None if prev is None else prev.next_input_ids, extras=True)
        padded = num_tokens - total
        self.num_padded_tokens += padded
        self.num_scheduled_tokens += total
        return PendingStep(arrays.row_request_ids, res, next_ids, padded, prompt_lp,
                           0 if prompt_targets is None else len(prompt_targets),
                           self._step_count, pooled, len(out.scheduled), routed, total, aux)

    def launch(self, inputs: StepInputs, prev_ids: jax.Array | None = None,
               extras: bool = False):
        """Dispatches one step's programs (model, prompt logprobs, sampler) on its inputs.

        Args:
            inputs: The step's packed buffers.
            prev_ids: i32[max_rows] the previous step's sampled ids (on the device), read
                for placeholder tokens; None when no step is in flight.
            extras: Also return the rows' pooled shares (a pooling runner's), the tokens'
                routed experts and aux hidden states (when captured); each else None.

        Returns:
            (SamplerOutput, i32[max_rows] next input ids, PromptLogprobs or None), all
            device arrays; with `extras`, then f32[num_rows, hidden], i32[num_tokens, L, k]
            and [num_tokens, n, hidden] (`StepPrograms.capture_aux`), each or None.
        """
        self.num_decode_steps += inputs.decode_only
        programs = self.programs
        model_buf = self.to_device(inputs.model_buf)
        self.kv_pages, logits, hidden, routed, aux = programs.model_step(
            inputs.model_layout, inputs.decode_only)(
            self.params, self.kv_pages, model_buf,
            self.no_prev_ids if prev_ids is None else prev_ids, self.lora_stacks,
            self.mm_buffer)
        pool = None
        if self.pooling_type is not None:
            pool = programs.pool(inputs.model_layout, self.pooling_type)(hidden, model_buf)
        prompt_lp = None
        if inputs.prompt_targets is not None:
            prompt_lp = programs.prompt_logprobs(inputs.num_prompt_logprobs)(
                self.params, hidden, self.to_device(inputs.prompt_targets))
        sample_buf, sample_layout = self.sampling_inputs(inputs.sampling, inputs.variant)
        res, next_ids = programs.sampler(sample_layout)(logits, self.to_device(sample_buf))
        return (res, next_ids, prompt_lp, *((pool, routed, aux) if extras else ()))


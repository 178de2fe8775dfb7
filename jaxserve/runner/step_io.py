"""What a step hands between host and device: its packed inputs, the dispatched step, the
samples brought back, and a model step prepared to run again and again (`ModelStep`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxserve.runner.transfer import Layout
from jaxserve.sample.metadata import SamplingMetadata


@dataclass
class PendingStep:
    """A dispatched step whose outputs may still be computing (device arrays).

    Attributes:
        row_request_ids: Request of each real sampling row.
        result: The sampler's `SamplerOutput` (device arrays, bucket-padded rows).
        next_input_ids: i32[max_rows]: the sampled ids, padded to a fixed length, which the
            next step reads for its placeholder tokens.
        num_padded_tokens: Padding in the token bucket.
        prompt_logprobs: Device `PromptLogprobs` of the bucket's tokens, or None.
        num_prompt_targets: Real tokens of `prompt_logprobs` (the rest is padding).
    """

    row_request_ids: list[str]
    result: object
    next_input_ids: jax.Array
    num_padded_tokens: int
    prompt_logprobs: object = None
    num_prompt_targets: int = 0
    step_id: int = 0
    pooled: object = None  # f32[num_rows, hidden] of a pooling runner (`pool_step`), or None
    num_pool_rows: int = 0  # its real rows (the scheduled requests, in their order)
    routed_experts: object = None  # i32[num_tokens bucket, L, k] captured routing, or None
    num_tokens: int = 0  # the step's real tokens (the scheduled ones, in their order)
    aux_hidden: object = None  # [num_tokens bucket, n, H] EAGLE-3 inputs (device), or None


@dataclass
class StepInputs:
    """One step's device inputs as host data: all a process needs to run the step's
    programs (what a multi-host leader broadcasts).

    Attributes:
        model_layout: Static layout of `model_buf`.
        model_buf: i32[n] the packed step arrays (`step_input.build_step_arrays`).
        decode_only: Whether the step runs the paged decode program.
        sampling: The step's sampling metadata as built (compact: arrays a variant adds
            are made by `launch`).
        variant: The sampler variant to run (None: the cheapest that fits).
        prompt_targets: i32[num_tokens] next prompt token per position, or None (no
            prompt logprobs this step).
        num_prompt_logprobs: The most top prompt logprobs a request of the step asked for
            (picks the program's width: `StepPrograms.prompt_logprobs`).
    """

    model_layout: Layout
    model_buf: np.ndarray
    decode_only: bool
    sampling: SamplingMetadata
    variant: str | None = None
    prompt_targets: np.ndarray | None = None
    num_prompt_logprobs: int = 0


@dataclass
class StepResult:
    """Host copies of what one step sampled, row by row (padding rows dropped).

    Attributes:
        row_request_ids: Request of each row.
        token_ids: i32[num_rows] sampled ids.
        logprobs: f32[num_rows] raw log-probability of each sampled id; None when no
            row asked for logprobs.
        token_ranks: i32[num_rows] rank of each sampled id (1 = most likely), or None.
        topk_token_ids: i32[num_rows, K] or None.
        topk_logprobs: f32[num_rows, K] or None.
        num_padded_tokens: Padding in the token bucket (for the waste metric).
        prompt_logprobs: For steps given `prompt_targets`: the `PromptLogprobs` of every
            (unpadded) token position, as host arrays; else None.
    """

    row_request_ids: list[str]
    token_ids: np.ndarray
    logprobs: np.ndarray | None
    token_ranks: np.ndarray | None
    topk_token_ids: np.ndarray | None
    topk_logprobs: np.ndarray | None
    num_padded_tokens: int
    prompt_logprobs: object = None
    pooled: np.ndarray | None = None  # f32[len(scheduled), hidden]: `PendingStep.pooled`
    # i32[real tokens, L, k]: each scheduled token's routed experts (in the scheduled
    # entries' order), when the runner captures routing; else None.
    routed_experts: np.ndarray | None = None
    # [num_tokens bucket, n, H] on the device: the residual stream entering each layer an
    # EAGLE-3 head reads (`StepPrograms.capture_aux`), tokens in the packed order; or None.
    aux_hidden: Any = None


@dataclass(frozen=True)
class ModelStep:
    """One step's model program bound to its inputs on the device, ready to run again and
    again: what warm-up lowers and runs, and what a benchmark times
    (`ModelRunner.prepare_model_step`; `ModelRunner.run_model_step` runs it on the
    runner's own weights and pool).

    Attributes:
        program: The jitted model step (`step_programs.model_step`): `(params, kv_pages,
            buf, prev_ids, lora_stacks, mm) -> (kv_pages, f32[sample rows, V] logits, hidden
            [num_tokens, H], routed experts or None, aux hidden states or None)`;
            `kv_pages` is donated (use the pool it returns).
        buf: i32[layout.size] the packed inputs, on the step's devices.
        layout: How `buf` unpacks (`transfer.Layout`).
        arrays: The host arrays packed into `buf` (`step_input.StepArrays`).
        prev_ids: i32[max_rows] what placeholder tokens read (zeros: no step before).
        lora_stacks: The adapter slot stacks every step reads (None: no adapters).
        decode_only: Whether `program` is the paged-decode variant.
        num_tokens: The token bucket.
        num_rows: The attention-row bucket.
        mm_buffer: The encoder cache's rows (a model taking images), or None.
    """

    program: Any
    buf: jax.Array
    layout: Layout
    arrays: Any
    prev_ids: jax.Array
    lora_stacks: dict | None
    decode_only: bool
    num_tokens: int
    num_rows: int
    mm_buffer: Any = None

    def run(self, params, kv_pages) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Runs the step on `params` and `kv_pages` (donated); returns (the new pool,
        logits, hidden), without waiting for the device."""
        return self.program(params, kv_pages, self.buf, self.prev_ids, self.lora_stacks,
                            self.mm_buffer)[:3]

    def lower(self, params, kv_pages):
        """The step lowered for `params` and `kv_pages` (`jax.stages.Lowered`: compile it,
        or read its HLO)."""
        return self.program.lower(params, kv_pages, self.buf, self.prev_ids, self.lora_stacks,
                                  self.mm_buffer)

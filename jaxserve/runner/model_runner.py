"""Device side of a step: page pool, padded inputs, jitted model step and sampler, warm-up.

Per step: execute the KV plans (copies, swaps), build the inputs in NumPy padded to a token
bucket, send them in one `device_put`, run the jitted model step (pool donated) and the
jitted sampler (`dispatch`, which returns at once: JAX dispatches asynchronously), and bring
the sampled ids (and logprobs) back (`fetch`, which waits for the device). A step may be
dispatched before the previous one is fetched: its placeholder tokens
(`scheduler_output.PLACEHOLDER`) are the ids the previous step sampled, read on the
device from that step's output.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.config import LoRAConfig
from jaxserve.core.plans import KVPlans
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.state_slots import default_num_state_slots
from jaxserve.parallel.sharding import TensorParallel
from jaxserve.runner import compile_counter
from jaxserve.runner.block_table_rows import BlockTableRows
from jaxserve.runner.buckets import token_buckets
from jaxserve.runner.encoder_cache import EncoderCache
from jaxserve.runner.kv_ops import HostSwapSpace, run_plans
from jaxserve.runner.lora_slots import LoRASlots
from jaxserve.runner.sampler_variants import promote, variant_of
from jaxserve.runner.sampling_rows import SamplingRows
from jaxserve.runner.state_pool import HostStateSpace, cache_pages, cache_shardings, empty_cache
from jaxserve.runner.step_dispatch import StepDispatch
from jaxserve.runner.step_input import rope_rows
from jaxserve.runner.step_io import ModelStep, PendingStep
from jaxserve.runner.step_packing import StepPacking
from jaxserve.runner.step_programs import StepPrograms, runner_model
from jaxserve.runner.transfer import Layout, pack
from jaxserve.runner.warmup import run_warmup
from jaxserve.sample.metadata import (
    MAX_BANNED_TOKEN_IDS,
    MAX_LOGPROBS,
    SamplingMetadata,
    logprobs_widths,
)
from jaxserve.utils import cdiv
from models.kv_groups import KVGroupLayout
from models.model import Model
from pallas_kernels.kv_quant import check_kv_cache_dtype, kv_pool_layout
from pallas_kernels.tuning import tuned


class ModelRunner(StepDispatch):
    """Owns the device page pool (with a model's linear-attention layers, its state pools
    too: `kv_pages` is then a `HybridCache`, `runner/state_pool.py`) and the compiled step
    programs (`programs`, a `StepPrograms`).

    Besides serving steps (`dispatch`, `fetch`: `runner/step_dispatch.py`), it prepares one
    step's model program with its inputs on the device for warm-up and benchmarks
    (`prepare_model_step`, `run_model_step`).

    Args:
        model: The loaded model.
        num_pages: Pages in the pool (the null page included).
        page_size: Slots per page.
        max_model_len: Longest sequence (sets the block-table width).
        max_num_seqs: Most requests per step.
        max_num_batched_tokens: Token budget per step (the largest bucket).
        num_swap_slots: Host pages for swapped-out requests.
        layout: Tensor-parallel layout (mesh and shardings, the experts' split over it);
            None runs on the default device.
        num_spec_tokens: Most proposals a request verifies per step (speculative
            decoding): each such request needs 1 + that many sampling rows, so a bucket
            has up to `max_num_seqs * (1 + num_spec_tokens)` of them.
        kv_cache_dtype: "auto" (`Model.kv_dtype`), a float dtype or an 8-bit KV format
            (`pallas_kernels.kv_quant`).
        short_tiles: Whether steps hold many requests of a few new tokens after a context
            (`AttentionMetadata.short_tiles`); None: when verifying proposals.
        eos_token_id: The EOS id banned with `stop_token_ids` below `min_tokens`.
        kv_layout: The KV cache groups the runner serves (`models.kv_groups`): with several,
            the pool holds `kv_layout.num_slots` layers per page, the runner keeps a block
            table per request and group, and every scheduled entry carries the tables of
            groups 1.. (`ScheduledRequest.group_pages`). None: the model's
            (`Model.kv_layout`; one group unless it was given one).
        lora: LoRA settings: with `enable_lora`, the runner keeps the adapter slots
            (`LoRASlots`) and every step carries each token's slot.
        routed_experts: Every step also brings back each token's routed experts (a
            mixture of experts; `StepResult.routed_experts`).
        max_logprobs: The engine's `max_logprobs` (-1: the whole vocabulary): above
            MAX_LOGPROBS the sampler and prompt-logprobs programs get a second, wide
            top-logprobs width (`logprobs_widths`), which warm-up compiles too.
        logprobs_mode: What sample logprobs hold (`jaxserve.sampling_params.LOGPROBS_MODES`).
        num_state_slots: For a model with linear-attention layers, the rows of its state
            pools, the null slot 0 included (the KV manager's `StateGroupSpec.num_slots`);
            None: `default_num_state_slots(max_num_seqs)`. Ignored for other models.

    Raises:
        ValueError: A `kv_layout` that does not fit the model (`models.model.check_kv_layout`),
            a KV cache dtype the backend cannot serve, or `routed_experts` on a model
            without a mixture of experts.
    """

    def __init__(self, model: Model, num_pages: int, page_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_swap_slots: int = 0,
                 layout: TensorParallel | None = None, num_spec_tokens: int = 0,
                 kv_cache_dtype: str = "auto", short_tiles: bool | None = None,
                 eos_token_id: int | None = None, kv_layout: KVGroupLayout | None = None,
                 lora: LoRAConfig | None = None, max_logprobs: int = MAX_LOGPROBS,
                 logprobs_mode: str = "raw_logprobs", routed_experts: bool = False,
                 num_state_slots: int | None = None):
        compile_counter.install()
        if routed_experts and not model.cfg.is_moe:
            raise ValueError("enable_return_routed_experts needs a mixture-of-experts model; "
                             f"{model.source or 'this model'} has no routed experts")
        model = runner_model(model, kv_layout, layout, lora)
        # NOTE: a copy of its own: `set_params` updates it in place (the compiled steps
        # hold it), never a model object the caller or another engine holds.
        self.model = dataclasses.replace(model)
        self.layout = layout
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.num_spec_tokens = num_spec_tokens
        self.short_tiles = num_spec_tokens > 0 if short_tiles is None else short_tiles
        self.max_pages_per_seq = cdiv(max_model_len, page_size)
        # Requests' block tables kept between steps (the scheduler sends what changed): group
        # 0's, and with a hybrid KV cache one `BlockTableRows` per group (group 0's first).
        self.block_tables = BlockTableRows(self.max_pages_per_seq, max_num_seqs)
        self.kv_layout = model.kv_groups  # the KV cache groups served (one: the plain pool)
        self.num_kv_groups = self.kv_layout.num_groups if model.is_hybrid else 1
        self.group_tables = [self.block_tables] + [
            BlockTableRows(self.max_pages_per_seq, max_num_seqs)
            for _ in range(self.num_kv_groups - 1)]
        # The top-logprobs widths compiled: MAX_LOGPROBS, and a wide one when max_logprobs
        # is larger (requests above MAX_LOGPROBS use it).
        self.logprobs_widths = logprobs_widths(max_logprobs, model.cfg.vocab_size)
        self.wide_logprobs = self.logprobs_widths[1] if len(self.logprobs_widths) > 1 else None
        # Requests' sampling rows kept between steps (written when each request joins).
        self.sampling_rows = SamplingRows(model.cfg.vocab_size, eos_token_id, max_num_seqs,
                                          self.wide_logprobs)
        self.penalty_len = 1 << (max_model_len - 1).bit_length()
        self.banned_len = MAX_BANNED_TOKEN_IDS
        # NOTE: the smallest bucket is tuned per backend (`pallas_kernels.tuning`): padded
        # rows cost compute on the XLA path, not in the Pallas kernels.
        self.buckets = token_buckets(max_num_batched_tokens,
                                     min_bucket=tuned("min_bucket")[model.methods.backend])
        # Data-parallel attention's ranks: each step holds a block of tokens per rank.
        self.num_ranks = 1 if layout is None else layout.num_attention_ranks
        if num_pages % self.num_ranks:
            raise ValueError(f"num_pages={num_pages} must split evenly over the "
                             f"{self.num_ranks} attention ranks")
        self.packing = StepPacking(self.buckets, max_num_seqs, num_spec_tokens, page_size,
                                   self.max_pages_per_seq, self.group_tables,
                                   model.has_linear_attention, self.num_ranks)
        self.max_rows = self.sample_rows(self.num_ranks * self.buckets[-1])
        check_kv_cache_dtype(kv_cache_dtype, model.methods.backend, model.dtype)
        pool_shape, pool_dtype = kv_pool_layout(model.kv_pages_shape(num_pages, page_size),
                                                model.kv_dtype, kv_cache_dtype)
        self._pool_layout = (pool_shape, pool_dtype)
        # The state pools' rows (0: no state group); host copies of swapped-out states.
        self.num_state_slots = 0
        self.state_swap = None
        if model.has_linear_attention:
            self.num_state_slots = num_state_slots or default_num_state_slots(max_num_seqs)
            self.state_swap = HostStateSpace()
        self._inputs_on = None if layout is None else layout.replicated()  # None: default
        self.set_params(model.params)
        self.alloc_kv_pool()
        self.lora = (LoRASlots(model, lora, layout) if lora is not None and lora.enable_lora
                     else None)
        self.encoder: EncoderCache | None = None  # images (`set_vision`)
        self.image_spans = False
        # i32[max_rows]: what a step reads for placeholders when no step precedes it.
        self.no_prev_ids = self.to_device(np.zeros(self.max_rows, np.int32))
        page_shape = pool_shape[:3] + pool_shape[4:]  # one page: [L, 2, Hkv, page_size, row]
        self.swap = HostSwapSpace(num_swap_slots, page_shape, pool_dtype)
        self.programs = StepPrograms(self.model, layout, self.short_tiles, self.max_rows,
                                     logprobs_mode, self.wide_logprobs, routed_experts)
        self.num_padded_tokens = 0
        self.num_scheduled_tokens = 0
        # Compilations inside this runner's steps since warm-up (other engines or user code
        # compiling in the same process are not counted).
        self.num_compilations = 0
        self.num_decode_steps = 0  # steps that ran the paged decode kernel
        # Multi-host leader: every device call is first sent to the other processes
        # (`jaxserve.parallel.step_channel`); None on one host and on followers.
        self.channel = None
        self._step_count = 0  # steps dispatched (their ids, for followers' placeholders)
        self.warmup_seconds = 0.0
        # (buckets compiled, buckets in all) while warm-up runs; read by `/health`.
        self.warmup_progress = (0, len(self.buckets))
        # A pooling runner's `PoolerConfig.pooling_type` (set by the engine): every step
        # also computes each row's pooled share on the device (`pool_step`); None: none.
        self.pooling_type: str | None = None

    # ------------------------------------------------------ device state
    def set_params(self, params) -> None:
        """Serves `params` (the model's serving form) from the next step on: placed on the
        layout's shardings (a no-op for leaves that have them already; params go shard by
        shard, never whole on one device). The old weights are dropped here, and the
        model object the compiled steps hold is updated in place, so nothing keeps them.
        """
        if params is not None and self.layout is not None:
            params = self.layout.shard_params(params)
        self.params = params
        self.model.params = self.params

    def alloc_kv_pool(self) -> None:
        """Allocates the page pool (zeros) and any state pools (`state_pool.empty_cache`),
        already split over the layout's mesh."""
        shape, dtype = self._pool_layout
        make = lambda: empty_cache(self.model, shape, dtype, self.num_state_slots)  # noqa: E731
        if self.layout is None:
            self.kv_pages = make()
        else:
            self.kv_pages = jax.jit(make, out_shardings=cache_shardings(self.layout,
                                                                        self.model))()

    def free_kv_pool(self) -> int:
        """Frees the page pool's device memory, state pools included (`alloc_kv_pool`
        gives it back); returns the bytes freed."""
        leaves = jax.tree_util.tree_leaves(self.kv_pages)
        for leaf in leaves:
            leaf.delete()
        self.kv_pages = None
        return sum(leaf.nbytes for leaf in leaves)

    @property
    def page_pool(self) -> jax.Array | None:
        """The page pool alone (`kv_pages` is it, or a `HybridCache` holding it); None
        while asleep."""
        return None if self.kv_pages is None else cache_pages(self.kv_pages)

    # --------------------------------------------------------------- step
    def sample_rows(self, num_tokens: int) -> int:
        """Sampling rows of a token bucket (`StepPacking.sample_rows`)."""
        return self.packing.sample_rows(num_tokens)

    def step_shape(self, out: SchedulerOutput) -> tuple[int, int]:
        """(num_tokens, num_rows) bucket of a step: the sampling rows must be num_rows."""
        return self.packing.shape(out)

    def prepare_model_step(self, out: SchedulerOutput, decode_only: bool | None = None,
                           lora_slots: np.ndarray | None = None) -> ModelStep:
        """Builds a step's model inputs, sends them to the device and picks its compiled
        model program, without running it: what warm-up lowers and runs, and what a
        benchmark times (`ModelStep.run` on a pool of its own, or `run_model_step`).

        Args:
            out: The step. Entries without `pages_from` carry whole block tables and
                leave nothing kept; entries with it apply their deltas to the rows this
                runner keeps, as a served step does.
            decode_only: Run the paged decode program; None: when the step qualifies
                (`is_decode_step`).
            lora_slots: i32[num_tokens] each token's adapter slot (-1: none) in place of
                the step's own, on a runner serving adapters; None: the step's.

        Raises:
            ValueError: The step does not fit the largest bucket or the block tables
                (`build_step_arrays`).
        """
        arrays, buf, layout, num_tokens, num_rows = self._model_inputs(out, None, lora_slots)
        if decode_only is None:
            decode_only = self.is_decode_step(out, num_tokens, num_rows)
        return ModelStep(self.programs.model_step(layout, decode_only), self.to_device(buf),
                         layout, arrays, self.no_prev_ids, self.lora_stacks, decode_only,
                         num_tokens, num_rows, self.mm_buffer)

    def run_model_step(self, step: ModelStep) -> tuple[jax.Array, jax.Array]:
        """Runs a prepared model step on the served weights and the runner's pool (which
        it replaces: its KV writes land there); returns (f32[sample rows, V] logits,
        hidden [num_tokens, H]) without waiting for the device."""
        self.kv_pages, logits, hidden = step.run(self.params, self.kv_pages)
        return logits, hidden

    def _model_inputs(self, out: SchedulerOutput, prev: PendingStep | None,
                      lora_slots: np.ndarray | None = None):
        """(host arrays, packed buffer, its layout, token bucket, row bucket) of a step."""
        prev_rows = None if prev is None else {
            req_id: row for row, req_id in reversed(list(enumerate(prev.row_request_ids)))}
        arrays, num_tokens, num_rows = self.packing.arrays(out, prev_rows)
        if lora_slots is not None:
            arrays.lora_slots = np.asarray(lora_slots, np.int32)
        elif self.lora is not None:
            arrays.lora_slots = self.lora.token_slots(out, num_tokens)
        if self.encoder is not None:  # images: encoded as needed, their rows per token
            self.encoder.ensure([item for s in out.scheduled for item in s.mm_items])
            rows, ends = self.encoder.token_rows(out.scheduled, num_tokens)
            arrays.mm_rows, arrays.span_end = rows, (ends if self.image_spans else None)
        if self.model.cfg.mrope_section:
            arrays.rope_positions = rope_rows(out.scheduled, arrays.positions)
        model_buf, model_layout = pack(arrays.device_tree())
        return arrays, model_buf, model_layout, num_tokens, num_rows

    def set_vision(self, tower, spans: bool, max_image_tokens: int) -> None:
        """Serves images from the next step on: an encoder cache for `tower`
        (`models.vision.towers.VisionTower`) of at least one step's placeholders and four
        of the largest images, and with `spans` each step's bidirectional span ends
        (`runner/encoder_cache.py`)."""
        rows = max(self.buckets[-1], 4 * max_image_tokens)
        self.encoder = EncoderCache(tower, rows, put=self.to_device)
        self.image_spans = spans

    @property
    def mm_buffer(self) -> jax.Array | None:
        """The encoder cache's rows every step of a model taking images reads, or None."""
        return None if self.encoder is None else self.encoder.buffer

    @property
    def lora_stacks(self) -> dict | None:
        """The LoRA slot stacks every step reads (None: no adapters served)."""
        return None if self.lora is None else self.lora.stacks

    def sampling_inputs(self, sampling: SamplingMetadata, variant: str | None = None
                        ) -> tuple[np.ndarray, Layout]:
        """The packed sampling buffer (i32) of the cheapest sampler variant that fits (or
        `variant`), and its layout (`programs.sampler(layout)` runs it)."""
        sampling = promote(sampling, variant or variant_of(sampling),
                           self.model.cfg.vocab_size, self.penalty_len, self.banned_len)
        return pack(sampling)

    def to_device(self, buf: np.ndarray) -> jax.Array:
        """One host buffer onto the step's devices (replicated over a mesh)."""
        if self._inputs_on is None:
            return jax.device_put(buf)
        if jax.process_count() > 1:  # every process holds the same (whole) buffer
            return jax.make_array_from_process_local_data(self._inputs_on, buf)
        return jax.device_put(buf, self._inputs_on)

    def is_decode_step(self, out: SchedulerOutput, num_tokens: int, num_rows: int) -> bool:
        """Whether a step runs the paged decode kernel: every request has one new token (and
        request i holds token i: `SchedulerOutput.decodes_first`) in a bucket whose token
        and row counts are equal, on a backend with a separate decode kernel (Pallas; the
        XLA path reads decode rows once per row by itself)."""
        return (self.model.methods.backend == "pallas" and num_tokens == num_rows
                and all(s.num_new_tokens == 1 for s in out.scheduled))

    def apply_kv_changes(self, out: SchedulerOutput) -> None:
        """Does what the KV manager counted as done when it scheduled `out`, whether the
        step runs or not (it may be empty, or fail before dispatch): forgets the kept
        block tables and sampling rows of requests whose pages were dropped
        (`released_request_ids`; first, as it cannot fail), then runs the page moves
        (`plans`)."""
        for tables in self.group_tables:
            tables.release(out.released_request_ids)
        self.sampling_rows.release(out)
        self.execute_plans(out.plans)

    # -------------------------------------------------------------- plans
    def execute_plans(self, plans: KVPlans | None) -> None:
        """Runs a step's page and state plans on the pools (`kv_ops.run_plans`), after
        sending them to the other processes of a multi-host leader."""
        if plans is None or plans.is_empty():
            return
        if self.channel is not None:
            self.channel.send("plans", plans)
        self.kv_pages = run_plans(self.kv_pages, self.swap, plans, self.state_swap)

    # ------------------------------------------------------------- warmup
    def warmup(self, make_dummy_sampling) -> float:
        """Compiles every bucket's model step, sampler variants and KV plan programs
        (`runner/warmup.py`), updating `warmup_progress` as buckets finish.

        Args:
            make_dummy_sampling: `num_rows -> SamplingMetadata` of all-padding rows.

        Returns:
            Seconds spent.
        """
        # NOTE: the other processes warm up on one message; what warm-up runs is not sent
        # (its decode pass goes through `execute`).
        channel, self.channel = self.channel, None
        try:
            if channel is not None:
                channel.send("warmup")
            self.warmup_seconds = run_warmup(self, make_dummy_sampling,
                                             progress=self._note_warmup_progress)
        finally:
            self.channel = channel
        self.num_padded_tokens = self.num_scheduled_tokens = self.num_compilations = 0
        return self.warmup_seconds

    def _note_warmup_progress(self, done: int, total: int) -> None:
        self.warmup_progress = (done, total)

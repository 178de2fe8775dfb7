"""The jitted programs of a step (model forward, pooling, prompt logprobs, sampler), the
model form they are built from (`runner_model`), the copy of their outputs to the host
(`result_on_host`), and `StepPrograms`, a runner's cache of them per input layout."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import LoRAConfig
from jaxserve.runner.state_pool import cache_shardings
from jaxserve.runner.step_io import PendingStep, StepResult
from jaxserve.runner.transfer import Layout, unpack
from jaxserve.sample.logprobs import compute_prompt_logprobs
from jaxserve.sample.metadata import MAX_LOGPROBS, logprobs_bucket
from jaxserve.sample.sampler import sample
from models.kv_groups import KVGroupLayout
from models.linear import forward_context, serving_form
from models.linear.lora import resolve_impl as resolve_lora_impl
from models.model import Model
from pallas_kernels import AttentionMetadata


def model_step(model: Model, layout: Layout, decode_only: bool, short_tiles: bool,
               routing: bool, aux_layers: tuple[int, ...], params, kv_pages, buf, prev_ids,
               lora=None, mm=None):
    """One step's model forward on its packed inputs `buf` (unpacked by `layout`): the
    placeholder tokens read from `prev_ids` (i32[max_rows]), every token's LoRA slot from
    the buffer when `lora` (the slot stacks) is given, image placeholders their rows of
    `mm` (the encoder cache's buffer [N, H]) by the buffer's `mm_rows`, and bidirectional
    spans (`AttentionMetadata.q_span_end`) from its `span_end` when it has one. Returns
    (kv_pages, f32[rows, vocab] logits of the sampled rows, hidden [num_tokens,
    hidden_size], routed, aux): `routed` is i32[num_tokens, num_layers, top_k] each token's
    routed experts when `routing` (a mixture of experts' routing capture), else None; `aux`
    is [num_tokens, n, hidden_size] the residual stream entering each of the `aux_layers`
    (an EAGLE-3 head's inputs), or None when there are none."""
    x = unpack(buf, layout)
    ranks = model.methods.attention.ranks  # data-parallel attention: the step by ranks
    # NOTE: `state_slots` (i32[num_rows]) travels only for models with linear-attention
    # layers, whose `kv_pages` is then a `HybridCache` (page pool and state pools).
    md = AttentionMetadata(x["slot_mapping"], x["block_tables"], x["kv_lens"], x["cu_q_lens"],
                           decode_only, short_tiles, state_slots=x.get("state_slots"),
                           num_ranks=1 if ranks is None else ranks.num_ranks,
                           q_span_end=x.get("span_end"))
    src = x["prev_rows"]  # i32[num_tokens]: row of the previous step's sample, or -1
    input_ids = jnp.where(src >= 0, prev_ids[jnp.maximum(src, 0)], x["input_ids"])
    positions = x["positions"]
    if ranks is not None:  # each rank's tokens on its device, from the embedding on
        split = NamedSharding(ranks.mesh, P(ranks.axis))
        input_ids, positions = (jax.lax.with_sharding_constraint(a, split)
                                for a in (input_ids, positions))
    mm_embeds = None if mm is None else (mm, x["mm_rows"])
    kv_pages, hidden, *extra = model.forward(params, input_ids, positions, kv_pages, md, lora,
                                             x.get("lora_slots"), routing=routing,
                                             aux_layers=aux_layers, mm_embeds=mm_embeds,
                                             rope_positions=x.get("rope_positions"))
    aux = extra.pop(0) if aux_layers else None
    # NOTE: the sampled rows are padded to the step's row count: methods that can skip the
    # padding rows (the CPU kernels) multiply only the real ones (`models.linear.context`).
    with forward_context(real_rows=x["sample_rows"][0]):  # f32[rows, vocab], padding rows 0
        logits = model.compute_logits(params, hidden[x["logits_indices"]])
    return kv_pages, logits, hidden, (extra[0] if routing else None), aux


def pool_step(layout: Layout, pooling_type: str, hidden, buf):
    """Each attention row's share of a pooled vector, from the final-normed `hidden`
    [num_tokens, hidden_size] of its new tokens (the rows' extents: `cu_q_lens` in `buf`):
    LAST the row's last token, CLS its first, MEAN the sum of its tokens (the host adds the
    chunks up and divides). Returns f32[num_rows, hidden_size]."""
    cu = unpack(buf, layout)["cu_q_lens"]  # i32[num_rows + 1]
    num_tokens, num_rows = hidden.shape[0], cu.shape[0] - 1
    hidden = hidden.astype(jnp.float32)
    if pooling_type == "LAST":
        return hidden[jnp.clip(cu[1:] - 1, 0, num_tokens - 1)]
    if pooling_type == "CLS":
        return hidden[jnp.clip(cu[:-1], 0, num_tokens - 1)]
    # i32[num_tokens]: each token's row; padding tokens (past cu[-1]) get num_rows (dropped).
    row = jnp.searchsorted(cu, jnp.arange(num_tokens, dtype=cu.dtype), side="right") - 1
    row = jnp.where(jnp.arange(num_tokens) < cu[-1], row, num_rows)
    return jnp.zeros((num_rows, hidden.shape[1]), jnp.float32).at[row].add(hidden, mode="drop")


def prompt_logprobs(model: Model, num_logprobs: int, params, hidden, next_token_ids):
    """Top logprobs and each prompt position's next-token logprob from every position."""
    # f32[num_tokens, vocab] logits of every position: only steps that asked for it.
    logits = model.compute_logits(params, hidden)
    return compute_prompt_logprobs(logits, next_token_ids, num_logprobs)


def sample_step(layout: Layout, max_rows: int, logprobs_mode: str, logits, buf):
    """Samples the rows (`buf`: packed `SamplingMetadata`; logprobs as `logprobs_mode`
    says); (SamplerOutput, the ids as i32[max_rows], what the next step's placeholders
    read)."""
    res = sample(logits, unpack(buf, layout), logprobs_mode)
    ids = res.token_ids  # i32[num_rows]
    return res, jnp.zeros(max_rows, jnp.int32).at[:ids.shape[0]].set(ids)  # i32[max_rows]


def small_program_options() -> dict:
    """XLA compiler options of the sampler and prompt-logprobs programs: on the CPU the
    legacy fusion emitters. Compiled in this process, a sampling program then holds
    about half the memory (10 vs 22 MB; 15 sampler programs at the default buckets);
    loaded from the persistent cache, either holds ~11 MB. Their speed is the same (4-64
    rows); the model steps keep the new emitters (7% faster at batch 32). BENCHMARKS.md,
    issue 49's memory."""
    return {"xla_cpu_use_fusion_emitters": False} if jax.default_backend() == "cpu" else {}


def runner_model(model: Model, kv_layout: KVGroupLayout | None, parallel,
                 lora: LoRAConfig | None) -> Model:
    """`model` in the form a runner's programs are built from: with its KV cache groups
    `kv_layout` (None: its own), its experts split as the tensor-parallel layout
    `parallel` says (None: one device), and the LoRA implementation `lora` resolves to
    (when adapters are served)."""
    # NOTE: a mixture of experts runs its experts per device under the layout's mesh
    # (`models.moe_parallel`); without a layout, on one device.
    experts = None if parallel is None else parallel.experts
    kv_layout = model.kv_layout if kv_layout is None else kv_layout
    if (kv_layout, experts) != (model.kv_layout, model.expert_sharding):
        model = dataclasses.replace(model, kv_layout=kv_layout, expert_sharding=experts)
    if lora is not None and lora.enable_lora:
        model = serving_form(model, lora_impl=resolve_lora_impl(lora.lora_impl, model.dtype,
                                                                parallel is None))
    return model


def to_host(tree):
    """NumPy copies of replicated device arrays (one local replica when a mesh spans
    processes, where the whole array is not addressable here)."""
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x if x.is_fully_addressable else x.addressable_data(0)), tree)


def result_on_host(pending: PendingStep) -> StepResult:
    """Waits for a dispatched step and copies its samples (and prompt logprobs, pooled
    shares) to the host, padding rows dropped; auxiliary hidden states stay on the device."""
    res = to_host(pending.result)
    prompt_lp = pooled = None
    if pending.pooled is not None:
        pooled = to_host(pending.pooled)[:pending.num_pool_rows]
    if pending.prompt_logprobs is not None:
        prompt_lp = jax.tree_util.tree_map(lambda x: x[:pending.num_prompt_targets],
                                           to_host(pending.prompt_logprobs))
    routed = None
    if pending.routed_experts is not None:
        routed = to_host(pending.routed_experts)[:pending.num_tokens]
    n = len(pending.row_request_ids)
    topk_ids = None if res.topk_token_ids is None else res.topk_token_ids[:n]
    topk_lp = None if res.topk_logprobs is None else res.topk_logprobs[:n]
    logprobs = None if res.logprobs is None else res.logprobs[:n]
    ranks = None if res.token_ranks is None else res.token_ranks[:n]
    return StepResult(pending.row_request_ids, res.token_ids[:n], logprobs, ranks,
                      topk_ids, topk_lp, pending.num_padded_tokens, prompt_lp, pooled, routed,
                      pending.aux_hidden)


class StepPrograms:
    """A runner's jitted step programs, each built on first use per input layout.

    Args:
        model: The runner's model (its params are the programs' arguments, not constants).
        parallel: The tensor-parallel layout (the model step's output shardings), or None.
        short_tiles: `AttentionMetadata.short_tiles` of the model steps.
        max_rows: Length of the sampled ids the samplers return for the next step's
            placeholders (`ModelRunner.max_rows`).
        logprobs_mode: What the samplers' logprobs hold (`sample`'s, static).
        wide_logprobs: The engine's wide top-logprobs width (`logprobs_widths`), or None.
        routing: The model steps also return every token's routed experts (a mixture of
            experts' routing capture).

    Attributes:
        aux_layers: The layers whose input residual stream the model steps also return
            (`capture_aux`; () none).
    """

    def __init__(self, model: Model, parallel, short_tiles: bool, max_rows: int,
                 logprobs_mode: str = "raw_logprobs", wide_logprobs: int | None = None,
                 routing: bool = False):
        self.model = model
        self.routing = routing
        self.parallel = parallel
        self.short_tiles = short_tiles
        self.max_rows = max_rows
        self.logprobs_mode = logprobs_mode
        self.wide_logprobs = wide_logprobs
        self._steps: dict[tuple[Layout, bool], object] = {}
        self._samplers: dict[Layout, object] = {}
        self._pools: dict[tuple[Layout, str], object] = {}
        self._prompt_logprobs: dict[int, object] = {}
        self.aux_layers: tuple[int, ...] = ()

    def capture_aux(self, layer_ids: tuple[int, ...]) -> None:
        """From now on the model steps also return the residual stream entering each of
        `layer_ids` (an EAGLE-3 head's inputs: `models.eagle3`); the steps built so far are
        dropped (call it before warm-up)."""
        self.aux_layers = tuple(layer_ids)
        self._steps.clear()

    def model_step(self, layout: Layout, decode_only: bool = False):
        """The model forward (`model_step`) of inputs packed as `layout`: `(params,
        kv_pages, buf, prev_ids, lora_stacks, mm) -> (kv_pages, logits, hidden, routed,
        aux)`, the pool donated; `decode_only` picks the paged-decode variant."""
        fn = self._steps.get((layout, decode_only))
        if fn is None:
            shardings = {} if self.parallel is None else {"out_shardings": (
                cache_shardings(self.parallel, self.model), *[self.parallel.replicated()] * 4)}
            fn = jax.jit(functools.partial(model_step, self.model, layout, decode_only,
                                           self.short_tiles, self.routing, self.aux_layers),
                         donate_argnums=1, **shardings)
            self._steps[(layout, decode_only)] = fn
        return fn

    def model_steps(self) -> dict[tuple[Layout, bool], object]:
        """The model steps built so far, by (input layout, decode_only)."""
        return dict(self._steps)

    def sampler(self, layout: Layout):
        """The sampler (`sample_step`) of sampling arrays packed as `layout`: `(logits,
        buf) -> (SamplerOutput, i32[max_rows] sampled ids)`."""
        fn = self._samplers.get(layout)
        if fn is None:
            fn = jax.jit(functools.partial(sample_step, layout, self.max_rows,
                                           self.logprobs_mode),
                         compiler_options=small_program_options())
            self._samplers[layout] = fn
        return fn

    def prompt_logprobs(self, num_logprobs: int = 0):
        """The prompt-logprobs program for a step whose requests ask for up to
        `num_logprobs` top logprobs: `(params, hidden, i32[num_tokens] next prompt tokens)
        -> PromptLogprobs` (`prompt_logprobs`), of MAX_LOGPROBS (`logprobs_bucket`: the
        engine's wide width above that), capped at V."""
        vocab_size = self.model.cfg.vocab_size
        width = min(max(logprobs_bucket(num_logprobs, self.wide_logprobs), MAX_LOGPROBS),
                    vocab_size)
        fn = self._prompt_logprobs.get(width)
        if fn is None:
            fn = jax.jit(functools.partial(prompt_logprobs, self.model, width),
                         compiler_options=small_program_options())
            self._prompt_logprobs[width] = fn
        return fn

    def pool(self, layout: Layout, pooling_type: str):
        """The pooling program (`pool_step`) of a step packed as `layout`: `(hidden, buf)
        -> f32[num_rows, hidden_size]` each row's share."""
        fn = self._pools.get((layout, pooling_type))
        if fn is None:
            fn = jax.jit(functools.partial(pool_step, layout, pooling_type))
            self._pools[(layout, pooling_type)] = fn
        return fn

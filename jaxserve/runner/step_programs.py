"""The jitted programs of a step (model forward, pooling, prompt logprobs, sampler), the copy
of their outputs to the host, and `StepPrograms`, the runner's cache of them per input
layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.transfer import Layout, unpack
from jaxserve.sample.logprobs import compute_prompt_logprobs
from jaxserve.sample.metadata import MAX_LOGPROBS
from jaxserve.sample.sampler import sample
from models.linear import forward_context
from models.model import Model
from pallas_kernels import AttentionMetadata


def model_step(model: Model, layout: Layout, decode_only: bool, short_tiles: bool, params,
                kv_pages, buf, prev_ids, lora=None):
    """One step's model forward on its packed inputs `buf` (unpacked by `layout`): the
    placeholder tokens read from `prev_ids` (i32[max_rows]), every token's LoRA slot from
    the buffer when `lora` (the slot stacks) is given. Returns (kv_pages, f32[rows, vocab]
    logits of the sampled rows, hidden [num_tokens, hidden_size])."""
    x = unpack(buf, layout)
    md = AttentionMetadata(x["slot_mapping"], x["block_tables"], x["kv_lens"], x["cu_q_lens"],
                           decode_only, short_tiles)
    src = x["prev_rows"]  # i32[num_tokens]: row of the previous step's sample, or -1
    input_ids = jnp.where(src >= 0, prev_ids[jnp.maximum(src, 0)], x["input_ids"])
    # NOTE: the step is padded to its bucket: methods that can skip the padding rows (the
    # CPU kernels) multiply only the real ones (`models.linear.context`).
    with forward_context(real_rows=md.num_real_tokens):
        kv_pages, hidden = model.forward(params, input_ids, x["positions"], kv_pages, md,
                                         lora, x.get("lora_slots"))
    with forward_context(real_rows=x["sample_rows"][0]):  # f32[rows, vocab], padding rows 0
        logits = model.compute_logits(params, hidden[x["logits_indices"]])
    return kv_pages, logits, hidden


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


def sample_step(layout: Layout, max_rows: int, logits, buf):
    """Samples the rows (`buf`: packed `SamplingMetadata`); (SamplerOutput, the ids as
    i32[max_rows], what the next step's placeholders read)."""
    res = sample(logits, unpack(buf, layout))
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


def to_host(tree):
    """NumPy copies of replicated device arrays (one local replica when a mesh spans
    processes, where the whole array is not addressable here)."""
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x if x.is_fully_addressable else x.addressable_data(0)), tree)


class StepPrograms:
    """Mixed into `ModelRunner`: its jitted programs, built on first use per input layout
    (reads `model`, `layout`, `short_tiles`, `max_rows`, `pooling_type` and the caches
    `_steps`, `_samplers`, `_pools`, `_prompt_logprobs`)."""

    def _pool_fn(self, layout: Layout):
        fn = self._pools.get(layout)
        if fn is None:
            fn = jax.jit(functools.partial(pool_step, layout, self.pooling_type))
            self._pools[layout] = fn
        return fn

    def _prompt_fn(self):
        if self._prompt_logprobs is None:
            self._prompt_logprobs = jax.jit(functools.partial(
                prompt_logprobs, self.model, min(MAX_LOGPROBS, self.model.cfg.vocab_size)),
                compiler_options=small_program_options())
        return self._prompt_logprobs

    def _step_fn(self, layout: Layout, decode_only: bool = False):
        fn = self._steps.get((layout, decode_only))
        if fn is None:
            shardings = {} if self.layout is None else {"out_shardings": (
                self.layout.kv_pages_sharding(), self.layout.replicated(),
                self.layout.replicated())}
            fn = jax.jit(functools.partial(model_step, self.model, layout, decode_only,
                                           self.short_tiles),
                         donate_argnums=1, **shardings)
            self._steps[(layout, decode_only)] = fn
        return fn

    def _sampler_fn(self, layout: Layout):
        fn = self._samplers.get(layout)
        if fn is None:
            fn = jax.jit(functools.partial(sample_step, layout, self.max_rows),
                         compiler_options=small_program_options())
            self._samplers[layout] = fn
        return fn

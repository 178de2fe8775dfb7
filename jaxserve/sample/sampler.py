"""On-device sampler: penalties, greedy, temperature, min-p/top-k/top-p, per-row seeded draws."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.sample.filters import apply_filters
from jaxserve.sample.logprobs import gather_logprobs
from jaxserve.sample.metadata import SamplingMetadata
from jaxserve.sample.rowwise import argmax_rows, categorical_rows
from jaxserve.sampling_params import LOGPROBS_MODES, SAMPLING_EPS


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["token_ids", "logprobs", "token_ranks", "topk_token_ids", "topk_logprobs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What one sampling step returns for R rows.

    Attributes:
        token_ids: i32[R] the sampled tokens.
        logprobs: f32[R] each sampled token's logprob: by default the raw log-softmax
            (model logits, before penalties and temperature), vLLM v1's "raw_logprobs"
            mode; else what `sample`'s `logprobs_mode` says.
        token_ranks: i32[R] rank of each sampled token under those values (1 = top).
            Both are None when no row asked for logprobs (`needs_logprobs` off).
        topk_token_ids: i32[R, K] or None when K = max_num_logprobs = 0.
        topk_logprobs: f32[R, K] or None; the same values of those alternatives, descending.
    """

    token_ids: Any
    logprobs: Any
    token_ranks: Any
    topk_token_ids: Any = None
    topk_logprobs: Any = None


def apply_banned_tokens(logits: jax.Array, banned_token_ids: jax.Array) -> jax.Array:
    """Sets banned ids to -inf; pad ids (== V) are dropped.

    Args:
        logits: f32[R, V].
        banned_token_ids: i32[R, Lb], padded with V.
    """
    rows = jnp.arange(logits.shape[0])[:, None]  # i32[R, 1]
    return logits.at[rows, banned_token_ids].set(-jnp.inf, mode="drop")


def apply_logit_controls(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """`allowed_token_ids` (every other id of a restricted row to -inf) then `logit_bias`
    (added to the logits, as OpenAI's and vLLM's rules say).

    Args:
        logits: f32[R, V].
        md: Metadata with `bias_token_ids`/`bias_values` [R, Lx], `allowed_token_ids`
            [R, La] (pad ids == V are dropped) and `restricted` i32[R].
    """
    num_rows, vocab_size = logits.shape
    rows = jnp.arange(num_rows)[:, None]  # i32[R, 1]
    restricted = jnp.asarray(md.restricted) > 0  # bool[R]

    def restrict(x):
        allowed = jnp.zeros((num_rows, vocab_size), jnp.bool_).at[
            rows, md.allowed_token_ids].set(True, mode="drop")  # bool[R, V]
        return jnp.where(restricted[:, None] & ~allowed, -jnp.inf, x)

    # NOTE: the [R, V] mask is built only in steps where some row is restricted.
    logits = jax.lax.cond(restricted.any(), restrict, lambda x: x, logits)
    return logits.at[rows, md.bias_token_ids].add(jnp.asarray(md.bias_values, jnp.float32),
                                                 mode="drop")


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Sets tokens a row's structured-output bitmask does not allow to -inf.

    Args:
        logits: f32[R, V].
        bitmask: i32[R, ceil(V / 32)]; bit `t % 32` of word `t // 32` allows token t.
    """
    num_rows, vocab_size = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)  # i32[32]
    bits = (jnp.asarray(bitmask, jnp.int32)[:, :, None] >> shifts) & 1  # i32[R, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab_size] > 0  # bool[R, V]
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Repetition, frequency and presence penalties (vLLM / transformers / OpenAI rules).

    Repetition: tokens seen in the prompt or the output have positive logits divided by
    the penalty and negative ones multiplied. Then `logit -= frequency * count +
    presence * (count > 0)` over output token counts only.

    Args:
        logits: f32[R, V].
        md: Metadata with `prompt_token_ids` i32[R, Lp] and `output_token_ids` i32[R, Lo].

    Returns:
        f32[R, V] penalised logits.
    """
    num_rows, vocab_size = logits.shape
    rows = jnp.arange(num_rows)[:, None]  # i32[R, 1]
    output_counts = jnp.zeros((num_rows, vocab_size), jnp.int32).at[
        rows, md.output_token_ids].add(1, mode="drop")  # i32[R, V]
    in_prompt = jnp.zeros((num_rows, vocab_size), jnp.bool_).at[
        rows, md.prompt_token_ids].set(True, mode="drop")  # bool[R, V]
    in_output = output_counts > 0  # bool[R, V]
    rep = md.repetition_penalty[:, None]  # f32[R, 1]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(in_prompt | in_output, penalised, logits)
    logits = logits - md.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - md.presence_penalty[:, None] * in_output.astype(jnp.float32)


def random_sample(logits: jax.Array, seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """Draws one token per row from softmax(logits).

    Row r inverts its CDF (`categorical_rows`) at two uniform numbers from the key
    `fold_in(key(seeds[r]), counters[r])`, so its token depends only on its logits, seed
    and counter.

    Args:
        logits: f32[R, V]; -inf entries are never drawn.
        seeds: u32[R].
        counters: i32[R].

    Returns:
        i32[R] token ids.
    """

    def row_uniforms(seed: jax.Array, counter: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), counter)
        bits = jax.random.bits(key, (2,), jnp.uint32) >> 9  # u32[2], 23 random bits each
        # NOTE: the middles of 2**23 steps, [2**-24, 1 - 2**-24]: never 0, which would
        # draw the first id with any mass however small it is.
        return (bits.astype(jnp.float32) + 0.5) * 2.0 ** -23  # f32[2]

    return categorical_rows(logits, jax.vmap(row_uniforms)(seeds, counters))


def _when(pred: jax.Array, stage, logits: jax.Array, arg) -> jax.Array:
    """`stage(logits, arg)` where `pred` holds (at run time), else `logits` unchanged."""
    return jax.lax.cond(pred, stage, lambda x, _: x, logits, arg)


def sample(logits: jax.Array, md: SamplingMetadata,
           logprobs_mode: str = "raw_logprobs") -> SamplerOutput:
    """Samples one token per row (jit-able; only `md`'s meta fields are static).

    Order as in vLLM v1: banned ids (min_tokens, bad words) -> allowed ids -> logit bias ->
    structured-output bitmask -> penalties -> greedy rows take the
    argmax -> temperature -> min-p, top-k, top-p -> seeded draw (the CDF inverted at
    two uniform numbers per row: the block of ids, then the id). The filters
    are compiled only when `md.needs_filtering`, the draw only when not `md.all_greedy`.

    Args:
        logits: f32[R, V] (any float dtype; computed in f32).
        md: The step's SamplingMetadata (NumPy or device arrays).
        logprobs_mode: Static; what the logprobs hold (`jaxserve.sampling_params.LOGPROBS_MODES`,
            vLLM's): the log-softmax ("*_logprobs") or the values ("*_logits") of `logits`
            ("raw_*") or of the logits drawn from ("processed_*": after every stage up to
            the filters; a greedy row's without temperature, as vLLM's; dropped ids -inf).

    Returns:
        SamplerOutput; logprobs as `logprobs_mode` says (None without `md.needs_logprobs`).

    Raises:
        ValueError: An unknown `logprobs_mode`.
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got "
                         f"{logprobs_mode!r}")
    processed_mode = logprobs_mode.startswith("processed") and md.needs_logprobs
    logits = logits.astype(jnp.float32)  # f32[R, V]
    raw_logits = logits
    vocab_size = logits.shape[-1]
    # NOTE: a stage the static flags compile in still runs only in steps where some row
    # uses it (promotion to "full" adds every stage as an identity).
    if md.has_banned_tokens:
        ids = jnp.asarray(md.banned_token_ids)
        logits = _when(jnp.any(ids < vocab_size), apply_banned_tokens, logits, ids)
    if md.has_logit_controls:
        logits = apply_logit_controls(logits, md)
    if md.has_bitmask:
        mask = jnp.asarray(md.token_bitmask)
        logits = _when(jnp.any(mask != -1), apply_token_bitmask, logits, mask)
    if md.has_penalties:
        used = (jnp.any(jnp.asarray(md.repetition_penalty) != 1.0)
                | jnp.any(jnp.asarray(md.frequency_penalty) != 0.0)
                | jnp.any(jnp.asarray(md.presence_penalty) != 0.0))
        logits = _when(used, apply_penalties, logits, md)
    token_ids = argmax_rows(logits)  # i32[R]
    processed = logits  # f32[R, V]: what greedy rows draw from (no temperature, no filters)
    if not md.all_greedy:
        temperature = jnp.asarray(md.temperature, jnp.float32)  # f32[R]
        is_greedy = temperature < SAMPLING_EPS  # bool[R]

        def scale_and_filter(logits: jax.Array) -> jax.Array:
            scaled = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]  # f32[R, V]
            if md.needs_filtering:
                top_k, top_p, min_p = (jnp.asarray(md.top_k), jnp.asarray(md.top_p),
                                       jnp.asarray(md.min_p))
                filtered = ~is_greedy & (((top_k > 0) & (top_k < vocab_size))
                                         | (top_p < 1.0) | (min_p > 0.0))  # bool[R]
                scaled = _when(jnp.any(filtered), lambda x, a: apply_filters(x, *a), scaled,
                               (top_k, top_p, min_p))
            return scaled

        def draw(logits: jax.Array) -> jax.Array:
            return random_sample(scale_and_filter(logits), jnp.asarray(md.seeds),
                                 jnp.asarray(md.counters))

        if processed_mode:
            # NOTE: the draw also hands back what it drew from (only in the processed modes:
            # the default program keeps no [R, V] result out of the cond).
            def draw_keep(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
                scaled = scale_and_filter(logits)
                ids = random_sample(scaled, jnp.asarray(md.seeds), jnp.asarray(md.counters))
                return ids, jnp.where(is_greedy[:, None], logits, scaled)

            random_ids, processed = jax.lax.cond(jnp.any(~is_greedy), draw_keep,
                                                 lambda x: (token_ids, x), logits)
        else:
            random_ids = jax.lax.cond(jnp.any(~is_greedy), draw,
                                      lambda _: token_ids, logits)  # i32[R]
        token_ids = jnp.where(is_greedy, token_ids, random_ids)
    if not md.needs_logprobs:
        return SamplerOutput(token_ids=token_ids, logprobs=None, token_ranks=None)
    token_logprobs, ranks, topk_ids, topk_logprobs = gather_logprobs(
        processed if processed_mode else raw_logits, token_ids, md.max_num_logprobs,
        normalize=logprobs_mode.endswith("logprobs"))
    return SamplerOutput(token_ids=token_ids, logprobs=token_logprobs, token_ranks=ranks,
                         topk_token_ids=topk_ids, topk_logprobs=topk_logprobs)

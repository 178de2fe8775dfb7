"""Verifying proposals against the target model: the rejection-sampling rule, jitted, static shapes.

For each row with `num_draft` proposals d_0.. (from a draft distribution q, or one-hot q
for n-gram proposals) and the target's distributions p_0..p_k at those positions:
proposal i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first
rejection the token is drawn from the residual max(p_i - q_i, 0) (normalised), and when
every proposal is accepted a bonus token is drawn from p_{num_draft}. The tokens produced
are then distributed exactly as the target's own samples (Leviathan et al. 2023, Chen et
al. 2023). A greedy row passes one-hot p (its argmax): it accepts the longest prefix equal
to the target's argmax and takes the argmax at the first mismatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def one_hot_probs(ids: jax.Array, vocab_size: int) -> jax.Array:
    """f32[..., V] one-hot distributions of `ids` (n-gram proposals, greedy targets)."""
    return jax.nn.one_hot(ids, vocab_size, dtype=jnp.float32)


@jax.jit
def rejection_sample(draft_ids: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
                     num_draft: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Accepts or rejects each row's proposals; returns the tokens the step produces.

    Args:
        draft_ids: i32[R, k] proposals (entries past `num_draft` are ignored).
        draft_probs: f32[R, k, V] the distribution each proposal was drawn from
            (`one_hot_probs(draft_ids)` for n-gram proposals).
        target_probs: f32[R, k + 1, V] the target's distribution at each proposal's
            position and one past the last (after all temperature/top-k/top-p processing).
        num_draft: i32[R] proposals of each row, 0..k (0: a plain decode step).
        keys: [R] typed PRNG keys, one per row (its seed and step: per-request seeds keep
            their guarantee whatever the batch).

    Returns:
        (i32[R, k + 1] tokens, -1 past each row's count; i32[R] tokens produced, which is
        1 + the number of accepted proposals).
    """
    r, k = draft_ids.shape
    pos = jnp.arange(k)  # i32[k]
    accept_keys, sample_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(accept_keys)  # f32[R, k]
    p_d = jnp.take_along_axis(target_probs[:, :k], draft_ids[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, draft_ids[..., None], -1)[..., 0]  # f32[R, k]
    # NOTE: u < p/q written as u * q < p: no division, and q == 0 (a proposal its own
    # distribution could not draw) accepts only where p > 0 as well.
    ok = (u * q_d < p_d) & (pos[None, :] < num_draft[:, None])  # bool[R, k]
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # i32[R]
    rows = jnp.arange(r)
    p_a = target_probs[rows, num_accepted]  # f32[R, V]
    q_a = draft_probs[rows, jnp.minimum(num_accepted, k - 1)]  # f32[R, V]
    rejected = (num_accepted < num_draft)[:, None]  # bool[R, 1]
    residual = jnp.where(rejected, jnp.maximum(p_a - q_a, 0.0), p_a)  # f32[R, V]
    # NOTE: a residual of all zeros (p == q at that position) cannot be rejected into;
    # fall back to p so the log below stays finite.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_a)
    last = jax.vmap(jax.random.categorical)(sample_keys, jnp.log(residual))  # i32[R]
    full = jnp.concatenate([draft_ids, jnp.zeros((r, 1), draft_ids.dtype)], axis=1)
    out_pos = jnp.arange(k + 1)[None, :]  # i32[1, k + 1]
    tokens = jnp.where(out_pos < num_accepted[:, None], full,
                       jnp.where(out_pos == num_accepted[:, None], last[:, None], -1))
    return tokens.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)


def greedy_accept(draft_ids: jax.Array, target_argmax: jax.Array,
                  num_draft: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The greedy case without probabilities: accept the longest prefix equal to the
    target's argmax, then its argmax. Same layout as `rejection_sample`'s result.

    Args:
        draft_ids: i32[R, k].
        target_argmax: i32[R, k + 1] the target's argmax at each position.
        num_draft: i32[R].
    """
    r, k = draft_ids.shape
    ok = (draft_ids == target_argmax[:, :k]) & (jnp.arange(k)[None, :] < num_draft[:, None])
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    out_pos = jnp.arange(k + 1)[None, :]
    tokens = jnp.where(out_pos <= num_accepted[:, None], target_argmax, -1)
    return tokens.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)

"""Per-request state slots of the linear-attention kernels: rows of the ragged batch, their
carried states, and the write-back (shared by `gated_delta` and `causal_conv1d`).

A linear layer keeps one fixed-size state per request instead of pages: a pool
`state[num_slots, ...]` per layer, slot 0 the null slot (padding rows name it, nothing
writes it). Row `i` of a step owns tokens `cu_q_lens[i]:cu_q_lens[i+1]`, the last
`q_len_i` of its `kv_lens[i]` tokens (as `AttentionMetadata`); it starts from a zero
state when `kv_lens[i] == q_len_i` (its first chunk, or a recompute after preemption),
else from `state[slots[i]]`, and its final state goes back to `state[slots[i]]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_rows(state: jax.Array, slots: jax.Array, cu_q_lens: jax.Array,
               kv_lens: jax.Array) -> int:
    """The number of rows R; ValueError naming the argument whose shape does not fit.

    Args:
        state: The layer's state pool, [num_slots, ...].
        slots: i32[R] each row's slot.
        cu_q_lens: i32[R + 1] cumulative query lengths.
        kv_lens: i32[R] context length of each row after this step.
    """
    if slots.ndim != 1:
        raise ValueError(f"slots must be i32[num_rows], got shape {slots.shape}")
    num_rows = slots.shape[0]
    if cu_q_lens.shape != (num_rows + 1,):
        raise ValueError(f"cu_q_lens {cu_q_lens.shape} must be [num_rows + 1] = "
                         f"[{num_rows + 1}] for slots {slots.shape}")
    if kv_lens.shape != (num_rows,):
        raise ValueError(f"kv_lens {kv_lens.shape} must be [num_rows] = [{num_rows}] for "
                         f"slots {slots.shape}")
    if state.ndim < 1 or state.shape[0] < 1:
        raise ValueError(f"state pool {state.shape} needs at least the null slot")
    return num_rows


def q_lens_of(cu_q_lens: jax.Array) -> jax.Array:
    """i32[R] tokens each row has in this step."""
    return cu_q_lens[1:] - cu_q_lens[:-1]


def token_rows(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(row, valid): i32[T] each token's row (clamped for padding), bool[T] False past the
    step's real tokens."""
    num_rows = cu_q_lens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    return jnp.minimum(row, num_rows - 1), t < cu_q_lens[num_rows]


def initial_states(state: jax.Array, slots: jax.Array, cu_q_lens: jax.Array,
                   kv_lens: jax.Array) -> jax.Array:
    """f32[R, ...] each row's starting state: zeros for a row at its first chunk
    (`kv_lens == q_len`, padding rows included), else its slot's (a select, so whatever a
    fresh row's slot holds, NaN included, never reaches it)."""
    fresh = kv_lens == q_lens_of(cu_q_lens)  # bool[R]
    carried = state[slots]  # f32[R, ...]
    mask = fresh.reshape(fresh.shape + (1,) * (carried.ndim - 1))
    return jnp.where(mask, jnp.zeros((), carried.dtype), carried)


def write_back(state: jax.Array, slots: jax.Array, cu_q_lens: jax.Array,
               final: jax.Array) -> jax.Array:
    """The pool with each row that had tokens this step holding its final state; rows
    without tokens (padding) write nothing, so slot 0 and unused slots keep their values.

    Two rows with tokens must not share a slot (the host's state group hands one slot to
    one request).
    """
    target = jnp.where(q_lens_of(cu_q_lens) > 0, slots, state.shape[0])  # i32[R]; S drops
    return state.at[target].set(final.astype(state.dtype), mode="drop")

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

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


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


def max_chunks(num_tokens: int, num_rows: int, chunk: int) -> int:
    """Static bound on the chunks of a step: rows of 2+ tokens are at most min(R, T // 2),
    and their chunks beyond the first of each number at most T // chunk."""
    return min(num_rows, num_tokens // 2) + num_tokens // chunk


def chunk_layout(cu_q_lens: jax.Array, num_tokens: int, chunk: int):
    """The chunks of `chunk` tokens of the rows with two or more tokens, aligned to each
    row's first token, in row order (the chunked XLA forms' loop: `run_chunks`).

    Returns:
        row: i32[C] each chunk's row (clamped for unused chunks).
        start: i32[C] its first token on the packed axis.
        length: i32[C] its tokens (0 for unused chunks).
        first: bool[C] the row's first chunk; last: bool[C] its last.
        count: i32[] chunks in use (they come first).
    """
    num_rows = cu_q_lens.shape[0] - 1
    q_lens = q_lens_of(cu_q_lens)  # i32[R]
    per_row = jnp.where(q_lens >= 2, (q_lens + chunk - 1) // chunk, 0)  # i32[R]
    cu_chunks = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per_row)])
    # NOTE: never fewer than 2 entries: with one, the loop's index into them is a constant
    # and XLA hoists the chunk's gathers and solve out of the loop, run even when no chunk
    # is in use (a decode step of one row paid them: ~6x its step).
    c = jnp.arange(max(2, max_chunks(num_tokens, num_rows, chunk)), dtype=jnp.int32)
    row = jnp.searchsorted(cu_chunks[1:], c, side="right").astype(jnp.int32)
    used = row < num_rows
    row = jnp.minimum(row, num_rows - 1)
    j = c - cu_chunks[row]  # the chunk's index within its row
    start = cu_q_lens[row] + j * chunk
    length = jnp.where(used, jnp.clip(q_lens[row] - j * chunk, 0, chunk), 0)
    return (row, start, length, used & (j == 0), used & (j == per_row[row] - 1),
            cu_chunks[-1])


def run_chunks(inputs: tuple, step: Callable, init: jax.Array, out: jax.Array,
               final: jax.Array, cu_q_lens: jax.Array, chunk: int):
    """The rows of two or more tokens, chunk by chunk (`chunk_layout`): one loop over the
    step's chunks carrying one row's state, reset at each row's first chunk and stored at
    its last; its trip count is the step's real chunk count.

    Args:
        inputs: Per-token arrays [T, heads, ...]; each chunk gets them as [heads, L, ...],
            zeros past the chunk's end.
        step: (state, *chunked inputs) -> (out [heads, L, ...], the state after the chunk).
        init: f32[R, ...] each row's starting state (`initial_states`).
        out: f32[T, heads, ...] the output, written at the chunks' tokens.
        final: f32[R, ...] each row's final state, written at its last chunk.
        cu_q_lens: i32[R + 1] cumulative query lengths.
        chunk: Tokens per chunk.

    Returns:
        (out, final).
    """
    num_tokens = out.shape[0]
    row, start, length, first, last, count = chunk_layout(cu_q_lens, num_tokens, chunk)
    if not row.shape[0]:
        return out, final
    pos = jnp.arange(chunk, dtype=jnp.int32)

    def gather(x, idx, inside):  # [T, heads, ...] -> [heads, L, ...]
        rows = jnp.take(x, idx, axis=0, mode="fill", fill_value=0)
        mask = inside.reshape(inside.shape + (1,) * (rows.ndim - 1))
        return jnp.moveaxis(jnp.where(mask, rows, 0.0), 0, 1)

    def body(i, carry):
        s, out, final = carry
        r = row[i]
        inside = pos < length[i]  # bool[L]
        idx = jnp.where(inside, start[i] + pos, num_tokens)  # i32[L]
        s = jnp.where(first[i], lax.dynamic_index_in_dim(init, r, keepdims=False), s)
        o, s = step(s, *(gather(x, idx, inside) for x in inputs))
        out = out.at[idx].set(jnp.moveaxis(o, 0, 1), mode="drop")
        stored = jnp.where(last[i], s, lax.dynamic_index_in_dim(final, r, keepdims=False))
        return s, out, lax.dynamic_update_index_in_dim(final, stored, r, 0)

    s0 = jnp.zeros(init.shape[1:], jnp.float32)
    _, out, final = lax.fori_loop(0, count, body, (s0, out, final))
    return out, final

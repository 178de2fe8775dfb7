"""Pure-jnp Mamba-2 selective scan (SSD), one token at a time (the oracle of the chunked XLA
form and of the Pallas kernel).

Per row and head h, with the state S f32[P, N] and token t's inputs:

    S = exp(dt_t * a_h) * S + dt_t * x_t b_t^T;  y_t = S c_t + d_h * x_t

Head h reads B/C group h // (H // G) (transformers' `repeat_interleave` over groups). This
is transformers' `mamba2_selective_state_update` token by token, D skip included; the
gated RMSNorm (`y * silu(z)` normalized per group) and the projections stay in the model.
Written for clarity, not speed: a `lax.scan` over every token of the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.state_slots import check_rows, initial_states, token_rows, write_back


def check_ssd_shapes(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens) -> None:
    """Raises ValueError naming the argument whose shape does not fit the others (see
    `ssd_reference` for the shapes)."""
    if x.ndim != 3:
        raise ValueError(f"x must be [num_tokens, num_heads, head_dim], got shape {x.shape}")
    num_tokens, num_heads, head_dim = x.shape
    if dt.shape != (num_tokens, num_heads):
        raise ValueError(f"dt {dt.shape} must be [num_tokens, num_heads] = "
                         f"[{num_tokens}, {num_heads}]")
    for name, v in (("a", a), ("d", d)):
        if v.shape != (num_heads,):
            raise ValueError(f"{name} {v.shape} must be [num_heads] = [{num_heads}]")
    if b.ndim != 3 or b.shape[0] != num_tokens:
        raise ValueError(f"b must be [num_tokens={num_tokens}, num_groups, state_size], got "
                         f"shape {b.shape}")
    num_groups, state_size = b.shape[1:]
    if num_groups < 1 or num_heads % num_groups:
        raise ValueError(f"b's {num_groups} groups (b {b.shape}) do not divide x's "
                         f"{num_heads} heads")
    if c.shape != b.shape:
        raise ValueError(f"c {c.shape} must have b's shape {b.shape}")
    if state.ndim != 4 or state.shape[1:] != (num_heads, head_dim, state_size):
        raise ValueError(f"state {state.shape} must be [num_slots, num_heads, head_dim, "
                         f"state_size] = [num_slots, {num_heads}, {head_dim}, {state_size}]")
    check_rows(state, slots, cu_q_lens, kv_lens)


def expand_groups(x: jax.Array, num_heads: int) -> jax.Array:
    """[T, G, N] -> [T, H, N]: head h gets group h // (H // G)."""
    return jnp.repeat(x, num_heads // x.shape[1], axis=1)


def ssd_step(s: jax.Array, x_t, dt_t, a, b_t, c_t, d) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence for a batch of heads.

    Args:
        s: f32[..., H, P, N] the state before the token.
        x_t: f32[..., H, P]; dt_t: f32[..., H]; a, d: f32[H]; b_t, c_t: f32[..., H, N].

    Returns:
        (y_t f32[..., H, P], the state after the token).
    """
    # Multiply-and-reduce rather than dots: one fused pass over S, f32 on every platform.
    s = (jnp.exp(dt_t * a)[..., None, None] * s
         + (dt_t[..., None] * x_t)[..., :, None] * b_t[..., None, :])
    y = jnp.sum(s * c_t[..., None, :], axis=-1) + d[:, None] * x_t
    return y, s


def ssd_reference(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens):
    """Mamba-2's selective scan over a ragged batch, token by token.

    Args:
        x: f32[T, H, P] per-head inputs (after the conv and its activation).
        dt: f32[T, H] step sizes (softplus(dt + dt_bias), clamped, by the caller).
        a: f32[H] A = -exp(A_log).
        b, c: f32[T, G, N] the input and output projections of the state (G divides H).
        d: f32[H] the skip (y += d * x).
        state: f32[S, H, P, N] one layer's state pool (slot 0 the null slot).
        slots: i32[R] each row's slot.
        cu_q_lens: i32[R + 1], kv_lens: i32[R] as `AttentionMetadata`.

    Returns:
        (y f32[T, H, P] zero on padding tokens, the pool with each row's final state in its
        slot; see `pallas_kernels.state_slots` for which rows start from zero).
    """
    check_ssd_shapes(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens)
    num_tokens, num_heads = dt.shape
    f32 = lambda v: v.astype(jnp.float32)
    be, ce = (expand_groups(f32(v), num_heads) for v in (b, c))  # f32[T, H, N]
    a, d = f32(a), f32(d)
    row, valid = token_rows(cu_q_lens, num_tokens)  # i32[T], bool[T]
    states = initial_states(f32(state), slots, cu_q_lens, kv_lens)  # f32[R, H, P, N]

    def step(states, xs):
        x_t, dt_t, b_t, c_t, r, ok = xs
        before = lax.dynamic_index_in_dim(states, r, keepdims=False)  # f32[H, P, N]
        y, after = ssd_step(before, x_t, dt_t, a, b_t, c_t, d)
        states = lax.dynamic_update_index_in_dim(states, jnp.where(ok, after, before), r, 0)
        return states, jnp.where(ok, y, 0.0)

    final, y = lax.scan(step, states, (f32(x), f32(dt), be, ce, row, valid))
    return y, write_back(state, slots, cu_q_lens, final)

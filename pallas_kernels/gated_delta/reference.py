"""Pure-jnp gated delta rule, one token at a time (the oracle of the chunked XLA form and of
the Pallas kernel).

Per row and value head, with the state S f32[dk, dv] and token t's inputs:

    S = exp(g_t) * S;  u = beta_t * (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t

Value head h reads key head h // (Hv // Hk) (transformers' `repeat_interleave`). Written
for clarity, not speed: a `lax.scan` over every token of the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.state_slots import check_rows, initial_states, token_rows, write_back

# f32 dots stay f32 (TPU's default would round their inputs to bf16).
HI = lax.Precision.HIGHEST


def check_gated_delta_shapes(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens) -> None:
    """Raises ValueError naming the argument whose shape does not fit the others (see
    `gated_delta_rule_reference` for the shapes)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_k_heads, dk], got shape {q.shape}")
    num_tokens, num_k_heads, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k {k.shape} must have q's shape {q.shape}")
    if v.ndim != 3 or v.shape[0] != num_tokens:
        raise ValueError(f"v must be [num_tokens={num_tokens}, num_v_heads, dv], got shape "
                         f"{v.shape}")
    num_v_heads, dv = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"v's {num_v_heads} value heads (v {v.shape}) are not a multiple of "
                         f"q/k's {num_k_heads} key heads")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (num_tokens, num_v_heads):
            raise ValueError(f"{name} {x.shape} must be [num_tokens, num_v_heads] = "
                             f"[{num_tokens}, {num_v_heads}]")
    if state.ndim != 4 or state.shape[1:] != (num_v_heads, dk, dv):
        raise ValueError(f"state {state.shape} must be [num_slots, num_v_heads, dk, dv] = "
                         f"[num_slots, {num_v_heads}, {dk}, {dv}]")
    check_rows(state, slots, cu_q_lens, kv_lens)


def expand_heads(x: jax.Array, num_v_heads: int) -> jax.Array:
    """[T, Hk, d] -> [T, Hv, d]: value head h gets key head h // (Hv // Hk)."""
    return jnp.repeat(x, num_v_heads // x.shape[1], axis=1)


def delta_step(s: jax.Array, q_t, k_t, v_t, g_t, beta_t) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence for a batch of heads.

    Args:
        s: f32[..., dk, dv] the state before the token.
        q_t, k_t: f32[..., dk]; v_t: f32[..., dv]; g_t, beta_t: f32[...].

    Returns:
        (o_t f32[..., dv], the state after the token).
    """
    # Multiply-and-reduce rather than dots: one fused pass over S each (a batch of
    # matrix-vector dots is XLA CPU's slow path), and f32 on every platform.
    s = jnp.exp(g_t)[..., None, None] * s
    kv_mem = jnp.sum(s * k_t[..., :, None], axis=-2)  # S^T k_t
    u = beta_t[..., None] * (v_t - kv_mem)
    s = s + k_t[..., :, None] * u[..., None, :]
    return jnp.sum(s * q_t[..., :, None], axis=-2), s


def gated_delta_rule_reference(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens):
    """The gated delta rule over a ragged batch, token by token.

    Args:
        q: f32[T, Hk, dk] queries, L2-normalized and scaled by dk ** -0.5 by the caller.
        k: f32[T, Hk, dk] keys, L2-normalized.
        v: f32[T, Hv, dv] values (Hv a multiple of Hk).
        g: f32[T, Hv] log decay (<= 0) applied to the state before each token's update.
        beta: f32[T, Hv] the update's strength.
        state: f32[S, Hv, dk, dv] one layer's state pool (slot 0 the null slot).
        slots: i32[R] each row's slot.
        cu_q_lens: i32[R + 1], kv_lens: i32[R] as `AttentionMetadata`.

    Returns:
        (out f32[T, Hv, dv] zero on padding tokens, the pool with each row's final state
        in its slot; see `pallas_kernels.state_slots` for which rows start from zero).
    """
    check_gated_delta_shapes(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens)
    num_tokens, num_v_heads = v.shape[:2]
    qe = expand_heads(q.astype(jnp.float32), num_v_heads)  # f32[T, Hv, dk]
    ke = expand_heads(k.astype(jnp.float32), num_v_heads)  # f32[T, Hv, dk]
    row, valid = token_rows(cu_q_lens, num_tokens)  # i32[T], bool[T]
    states = initial_states(state.astype(jnp.float32), slots, cu_q_lens, kv_lens)

    def step(states, xs):  # states: f32[R, Hv, dk, dv], one per row
        q_t, k_t, v_t, g_t, b_t, r, ok = xs
        before = lax.dynamic_index_in_dim(states, r, keepdims=False)  # f32[Hv, dk, dv]
        o, after = delta_step(before, q_t, k_t, v_t, g_t, b_t)
        states = lax.dynamic_update_index_in_dim(states, jnp.where(ok, after, before), r, 0)
        return states, jnp.where(ok, o, 0.0)

    xs = (qe, ke, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32),
          row, valid)
    final, out = lax.scan(step, states, xs)
    return out, write_back(state, slots, cu_q_lens, final)

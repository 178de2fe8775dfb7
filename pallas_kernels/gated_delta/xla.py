"""The gated delta rule in plain XLA, chunked (what the "xla" and "cpu" backends serve with).

Each row with two or more tokens is cut into chunks of `CHUNK` tokens aligned to its first
token; a chunk's tokens are folded into the state with a few matmuls by the WY (UT
transform) form of transformers' `torch_chunk_gated_delta_rule` (and flash-linear-
attention's `chunk_gated_delta_rule`). Within a chunk, with c_i the cumulative log decay up
to token i and D[i, j] = exp(c_i - c_j) for j <= i (0 above the diagonal):

    A = I + strictly_lower((beta k) k^T * D)        (the UT system, unit lower triangular)
    U = A^-1 (beta v);  W = A^-1 (beta k exp(c))    (new values; decayed keys reading S)
    V' = U - W S                                     (the part S does not predict)
    O = (q exp(c)) S + ((q k^T) * D) V'
    S = exp(c_last) S + (k exp(c_last - c))^T V'

A row of one token (a decode) takes the recurrent step instead, all such rows at once. The
chunks of all rows run in one loop whose trip count is the step's real chunk count (static
shapes: the buffers are sized by the bound `pallas_kernels.state_slots.max_chunks`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta.reference import (
    HI,
    check_gated_delta_shapes,
    delta_step,
    expand_heads,
)
from pallas_kernels.state_slots import initial_states, q_lens_of, run_chunks, write_back

CHUNK = 64


def chunk_step(s, q, k, v, g, beta):
    """One chunk of one row for all value heads (tokens past the chunk's end carry zero k,
    beta and g, so they leave the state as it is).

    Args:
        s: f32[Hv, dk, dv] the state before the chunk.
        q, k: f32[Hv, L, dk]; v: f32[Hv, L, dv]; g, beta: f32[Hv, L].

    Returns:
        (out f32[Hv, L, dv], the state after the chunk).
    """
    size = g.shape[-1]
    c = jnp.cumsum(g, axis=-1)  # f32[Hv, L]
    causal = jnp.tril(jnp.ones((size, size), bool))
    # exp of a masked difference: above the diagonal c_i - c_j > 0 could overflow.
    decay = jnp.exp(jnp.where(causal, c[..., :, None] - c[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]  # f32[Hv, L, dk]
    mm = lambda a, b: jnp.einsum("hij,hjk->hik", a, b, precision=HI)
    mt = lambda a, b: jnp.einsum("hik,hjk->hij", a, b, precision=HI)  # a @ b^T
    ut = jnp.where(jnp.tril(causal, -1), mt(k_beta, k) * decay, 0.0) + jnp.eye(size)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(c)[..., None]], axis=-1)
    solved = lax.linalg.triangular_solve(ut, rhs, left_side=True, lower=True,
                                         unit_diagonal=True)  # f32[Hv, L, dv + dk]
    new_v, k_cum = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    v_new = new_v - mm(k_cum, s)  # f32[Hv, L, dv]
    out = mm(q * jnp.exp(c)[..., None], s) + mm(mt(q, k) * decay, v_new)
    c_last = c[..., -1:]  # f32[Hv, 1]
    k_dec = k * jnp.exp(c_last - c)[..., None]  # f32[Hv, L, dk]
    s = jnp.exp(c_last)[..., None] * s + jnp.einsum("hlk,hlv->hkv", k_dec, v_new, precision=HI)
    return out, s


def gated_delta_rule_xla(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens, *,
                         chunk: int = CHUNK):
    """The gated delta rule over a ragged batch, chunked; same contract and result as
    `gated_delta_rule_reference` (up to float rounding)."""
    check_gated_delta_shapes(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens)
    num_tokens, num_v_heads, dv = v.shape
    f32 = lambda x: x.astype(jnp.float32)
    qe, ke = (expand_heads(f32(x), num_v_heads) for x in (q, k))  # f32[T, Hv, dk]
    v, g, beta = f32(v), f32(g), f32(beta)
    q_lens = q_lens_of(cu_q_lens)  # i32[R]
    init = initial_states(f32(state), slots, cu_q_lens, kv_lens)  # f32[R, Hv, dk, dv]
    out = jnp.zeros((num_tokens, num_v_heads, dv), jnp.float32)

    # Decode rows: one recurrent step each, all rows at once.
    first_tok = jnp.minimum(cu_q_lens[:-1], num_tokens - 1)  # i32[R]
    o1, s1 = delta_step(init, qe[first_tok], ke[first_tok], v[first_tok], g[first_tok],
                        beta[first_tok])
    decode = q_lens == 1  # bool[R]
    out = out.at[jnp.where(decode, first_tok, num_tokens)].set(o1, mode="drop")
    final = jnp.where(decode[:, None, None, None], s1, init)

    out, final = run_chunks((qe, ke, v, g, beta), chunk_step, init, out, final, cu_q_lens,
                            chunk)
    return out, write_back(state, slots, cu_q_lens, final)


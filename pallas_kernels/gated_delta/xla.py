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
shapes: the buffers are sized by the bound `max_chunks`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gated_delta.reference import (
    HI,
    check_gated_delta_shapes,
    delta_step,
    expand_heads,
)
from pallas_kernels.state_slots import initial_states, q_lens_of, write_back

CHUNK = 64


def max_chunks(num_tokens: int, num_rows: int, chunk: int = CHUNK) -> int:
    """Static bound on the chunks of a step: rows of 2+ tokens are at most min(R, T // 2),
    and their chunks beyond the first of each number at most T // chunk."""
    return min(num_rows, num_tokens // 2) + num_tokens // chunk


def chunk_layout(cu_q_lens: jax.Array, num_tokens: int, chunk: int = CHUNK):
    """The chunks of the rows with two or more tokens, in row order.

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
    c = jnp.arange(max_chunks(num_tokens, num_rows, chunk), dtype=jnp.int32)
    row = jnp.searchsorted(cu_chunks[1:], c, side="right").astype(jnp.int32)
    used = row < num_rows
    row = jnp.minimum(row, num_rows - 1)
    j = c - cu_chunks[row]  # the chunk's index within its row
    start = cu_q_lens[row] + j * chunk
    length = jnp.where(used, jnp.clip(q_lens[row] - j * chunk, 0, chunk), 0)
    return (row, start, length, used & (j == 0), used & (j == per_row[row] - 1),
            cu_chunks[-1])


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
    dk = q.shape[-1]
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

    row, start, length, first, last, count = chunk_layout(cu_q_lens, num_tokens, chunk)
    if row.shape[0]:
        out, final = _chunks(qe, ke, v, g, beta, init, out, final,
                             (row, start, length, first, last, count), chunk, dk)
    return out, write_back(state, slots, cu_q_lens, final)


def _chunks(qe, ke, v, g, beta, init, out, final, layout, chunk, dk):
    """The rows of two or more tokens: a loop over the step's chunks carrying one row's
    state, reset at each row's first chunk and stored at its last."""
    row, start, length, first, last, count = layout
    num_tokens, num_v_heads, dv = v.shape
    pos = jnp.arange(chunk, dtype=jnp.int32)

    def gather(x, idx, inside):  # [T, Hv, ...] -> [Hv, L, ...], zeros past the chunk
        rows = jnp.take(x, idx, axis=0, mode="fill", fill_value=0)
        mask = inside.reshape(inside.shape + (1,) * (rows.ndim - 1))
        return jnp.moveaxis(jnp.where(mask, rows, 0.0), 0, 1)

    def body(i, carry):
        s, out, final = carry
        r = row[i]
        inside = pos < length[i]  # bool[L]
        idx = jnp.where(inside, start[i] + pos, num_tokens)  # i32[L]
        s = jnp.where(first[i], lax.dynamic_index_in_dim(init, r, keepdims=False), s)
        o, s = chunk_step(s, *(gather(x, idx, inside) for x in (qe, ke, v, g, beta)))
        out = out.at[idx].set(jnp.moveaxis(o, 0, 1), mode="drop")
        stored = jnp.where(last[i], s, lax.dynamic_index_in_dim(final, r, keepdims=False))
        return s, out, lax.dynamic_update_index_in_dim(final, stored, r, 0)

    s0 = jnp.zeros((num_v_heads, dk, dv), jnp.float32)
    _, out, final = lax.fori_loop(0, count, body, (s0, out, final))
    return out, final

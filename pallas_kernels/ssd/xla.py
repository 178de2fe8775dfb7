"""Mamba-2's selective scan in plain XLA, chunked (what the "xla" and "cpu" backends serve with).

Each row with two or more tokens is cut into chunks of `CHUNK` tokens aligned to its first
token (`pallas_kernels.state_slots.chunk_layout`); a chunk's tokens are
folded into the state with a few matmuls, the state space duality of transformers'
`mamba2_chunk_scan` (and mamba_ssm's `mamba_chunk_scan_combined`). Within a chunk, per head,
with c_i the cumulative log decay (dt a) up to token i and D[i, j] = exp(c_i - c_j) for
j <= i (0 above the diagonal), X = dt x (the discretized input):

    Y = ((C B^T) * D) X + exp(c) (C S^T)            (in-chunk part, and the carried state)
    S = exp(c_last) S + (exp(c_last - c) X)^T B

and y = Y + d x. A row of one token (a decode) takes the recurrent step instead, all such
rows at once. The chunks of all rows run in one loop whose trip count is the step's real
chunk count (`pallas_kernels.state_slots.run_chunks`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ssd.reference import check_ssd_shapes, expand_groups, ssd_step
from pallas_kernels.state_slots import (
    initial_states,
    q_lens_of,
    run_chunks,
    token_rows,
    write_back,
)

CHUNK = 64
# f32 dots stay f32 (TPU's default would round their inputs to bf16).
HI = lax.Precision.HIGHEST


def chunk_step(s, x, dt, a, b, c):
    """One chunk of one row for all heads, without the d skip (tokens past the chunk's end
    carry zero dt, so they leave the state as it is).

    Args:
        s: f32[H, P, N] the state before the chunk.
        x: f32[H, L, P]; dt: f32[H, L]; a: f32[H]; b, c: f32[G, L, N] (by group).

    Returns:
        (y f32[H, L, P], the state after the chunk).
    """
    num_heads, size = dt.shape
    per_group = num_heads // b.shape[0]
    cum = jnp.cumsum(dt * a[:, None], axis=-1)  # f32[H, L]
    causal = jnp.tril(jnp.ones((size, size), bool))
    # exp of a masked difference: above the diagonal c_i - c_j > 0 could overflow.
    decay = jnp.exp(jnp.where(causal, cum[:, :, None] - cum[:, None, :], -jnp.inf))
    # C B^T once per group (Mamba-2 models have few groups and many heads).
    scores = jnp.repeat(jnp.einsum("gln,gsn->gls", c, b, precision=HI), per_group, axis=0)
    xdt = x * dt[..., None]  # f32[H, L, P]
    bh, ch = jnp.repeat(b, per_group, axis=0), jnp.repeat(c, per_group, axis=0)  # [H, L, N]
    y = (jnp.einsum("hls,hsp->hlp", scores * decay, xdt, precision=HI)
         + jnp.exp(cum)[..., None] * jnp.einsum("hln,hpn->hlp", ch, s, precision=HI))
    last = cum[:, -1:]  # f32[H, 1]
    s = (jnp.exp(last)[..., None] * s
         + jnp.einsum("hlp,hln->hpn", xdt * jnp.exp(last - cum)[..., None], bh, precision=HI))
    return y, s


# Jitted so that eager callers (tests, `pallas_kernels.ops.ssd` outside a model) share one
# compilation per shape; inside the model's jit it is inlined.
@functools.partial(jax.jit, static_argnames=("chunk",))
def ssd_xla(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens, *, chunk: int = CHUNK):
    """Mamba-2's selective scan over a ragged batch, chunked; same contract and result as
    `ssd_reference` (up to float rounding)."""
    check_ssd_shapes(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens)
    num_tokens, num_heads, head_dim = x.shape
    f32 = lambda v: v.astype(jnp.float32)
    x, dt, a, d, b, c = (f32(v) for v in (x, dt, a, d, b, c))
    init = initial_states(f32(state), slots, cu_q_lens, kv_lens)  # f32[R, H, P, N]
    y = jnp.zeros((num_tokens, num_heads, head_dim), jnp.float32)

    # Decode rows: one recurrent step each, all rows at once (the d skip comes at the end).
    first = jnp.minimum(cu_q_lens[:-1], num_tokens - 1)  # i32[R]
    y1, s1 = ssd_step(init, x[first], dt[first], a, expand_groups(b[first], num_heads),
                      expand_groups(c[first], num_heads), jnp.zeros_like(d))
    decode = q_lens_of(cu_q_lens) == 1  # bool[R]
    y = y.at[jnp.where(decode, first, num_tokens)].set(y1, mode="drop")
    final = jnp.where(decode[:, None, None, None], s1, init)

    step = lambda s, xc, dtc, bc, cc: chunk_step(s, xc, dtc, a, bc, cc)  # noqa: E731
    y, final = run_chunks((x, dt, b, c), step, init, y, final, cu_q_lens, chunk)
    _, valid = token_rows(cu_q_lens, num_tokens)  # bool[T]
    y = jnp.where(valid[:, None, None], y + d[:, None] * x, 0.0)
    return y, write_back(state, slots, cu_q_lens, final)


"""Row-wise argmax, top-k and categorical draws over the vocabulary in two stages (blocks).

XLA:CPU runs `jnp.argmax` over [R, V] as one variadic (value, index) reduction that it
does not vectorize: 15 ms for R=128, V=49152 on this project's 2-core CPU, where a plain
`max` over the same array takes 0.6 ms. Reducing each block of `BLOCK` ids first, then
the R x V/BLOCK block results, then the one winning block, gives the same answer in
~0.5 ms. A categorical draw by inverting the CDF at two uniform numbers per row needs one
exponential per logit, where a Gumbel-max draw needs a threefry number and two logarithms
per logit (28 ms at R=32). `lax.top_k` over the k best blocks instead of the row: 5x
faster for k=20 at R=32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Ids per block of the first stage.
BLOCK = 128


def _blocks(x: jax.Array, fill: float, block: int = BLOCK) -> jax.Array:
    """[R, V] -> [R, ceil(V / block), block], the tail padded with `fill`."""
    num_rows, vocab_size = x.shape
    num_blocks = -(-vocab_size // block)
    if num_blocks * block != vocab_size:
        x = jnp.pad(x, ((0, 0), (0, num_blocks * block - vocab_size)), constant_values=fill)
    return x.reshape(num_rows, num_blocks, block)


def _pick(xb: jax.Array, block: jax.Array) -> jax.Array:
    """Row r's block `block[r]` of xb [R, nb, B]: [R, B]."""
    return jnp.take_along_axis(xb, block[:, None, None], axis=1)[:, 0]


def argmax_rows(x: jax.Array) -> jax.Array:
    """Each row's first index of its largest value, as `jnp.argmax(x, axis=-1)`.

    Args:
        x: f[R, V] without NaN (where a row has one, the id returned may differ from
            `jnp.argmax`'s).

    Returns:
        i32[R].
    """
    if x.shape[-1] <= BLOCK:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    xb = _blocks(x, -jnp.inf)  # f[R, nb, B]
    block = jnp.argmax(jnp.max(xb, axis=-1), axis=-1).astype(jnp.int32)  # i32[R]
    inner = jnp.argmax(_pick(xb, block), axis=-1).astype(jnp.int32)  # i32[R]
    return block * BLOCK + inner


def _first_above(cum: jax.Array, mass: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the first j with cum[j] > target and mass[j] > 0, or the last j with
    mass[j] > 0 when rounding left none above (cum, mass: f32[R, n]; target f32[R, 1])."""
    n = cum.shape[-1]
    j = jax.lax.broadcasted_iota(jnp.int32, cum.shape, 1)  # i32[R, n]
    first = jnp.min(jnp.where((cum > target) & (mass > 0), j, n), axis=-1)  # i32[R]
    last = jnp.max(jnp.where(mass > 0, j, -1), axis=-1)  # i32[R]
    return jnp.where(first < n, first, jnp.maximum(last, 0))


def categorical_rows(logits: jax.Array, uniform: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits), by inverting two CDFs in turn.

    The first uniform picks a block of `BLOCK` ids by the blocks' masses, the second an id
    of that block by the ids' masses in it: P(id) = P(block) P(id | block), and each
    stage resolves a float32 uniform's steps against its own total (a token that is rare
    in the row but not in its block is still drawn at its rate). Ids at -inf are never
    drawn; a row that is -inf everywhere draws id 0.

    Args:
        logits: f32[R, V].
        uniform: f32[R, 2] in [0, 1).

    Returns:
        i32[R] token ids.
    """
    vocab_size = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)  # f32[R, 1]
    finite = jnp.isfinite(top)  # bool[R, 1]
    probs = jnp.exp(logits - jnp.where(finite, top, 0.0))  # f32[R, V], unnormalised
    pb = _blocks(probs, 0.0)  # f32[R, nb, B]
    mass = jnp.sum(pb, axis=-1)  # f32[R, nb]
    cum = jnp.cumsum(mass, axis=-1)  # f32[R, nb]
    block = _first_above(cum, mass, uniform[:, :1] * cum[:, -1:])  # i32[R]
    inner_p = _pick(pb, block)  # f32[R, B]
    inner_cum = jnp.cumsum(inner_p, axis=-1)  # f32[R, B]
    inner = _first_above(inner_cum, inner_p, uniform[:, 1:] * inner_cum[:, -1:])  # i32[R]
    ids = jnp.minimum(block * BLOCK + inner, vocab_size - 1)
    return jnp.where(finite[:, 0], ids, 0).astype(jnp.int32)


def top_k_rows(x: jax.Array, k: int, block: int = 16) -> tuple[jax.Array, jax.Array]:
    """Each row's k largest values, descending, and their ids, as `lax.top_k(x, k)`.

    The k largest values of a row lie in the k blocks (of `block` ids) with the largest
    block maxima (any other block's maximum is exceeded by k others), so `lax.top_k` runs
    over those k blocks' ids rather than the whole row. Values equal to the k-th may come
    from other ids than `lax.top_k` would pick (the values are the same).

    Args:
        x: f[R, V] without NaN.
        k: Static, at most V.
        block: Static, ids per block.

    Returns:
        (f[R, k] values, i32[R, k] ids).
    """
    num_rows, vocab_size = x.shape
    if 4 * k * block > vocab_size:  # too few blocks to leave most of them out
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    xb = _blocks(x, -jnp.inf, block)  # f[R, nb, block]
    blocks = jax.lax.top_k(jnp.max(xb, axis=-1), k)[1]  # i32[R, k]
    cand = jnp.take_along_axis(xb, blocks[:, :, None], axis=1)  # f[R, k, block]
    values, pos = jax.lax.top_k(cand.reshape(num_rows, k * block), k)  # [R, k] each
    ids = jnp.take_along_axis(blocks, pos // block, axis=1) * block + pos % block
    # NOTE: a padding id (>= V, value -inf) only where the row has fewer than k values
    # above -inf; its value says so.
    return values, jnp.minimum(ids, vocab_size - 1).astype(jnp.int32)

"""The online-softmax (flash attention) step shared by the GPU-style Pallas kernels.

Kernels keep a carry `(o f32[rows, D], m f32[rows], lsum f32[rows])` and feed it one block
of keys at a time; rows are query heads (times query tokens), the block is
`pages_per_block` pages of one KV head read through the block table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kv_quant import dequantize_kv

MASK = -1e30  # finite "minus infinity": exp(MASK - m) underflows to 0 without NaN


def init_carry(rows: int, head_dim: int):
    """Empty accumulator: no keys seen yet."""
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def load_pages(kv_ref, tables_ref, row, j: jax.Array, page_base, v_offset, pages_per_block: int,
               head_dim: int):
    """K and V (f32) of block `j` of table row `row`: [block_k, head_dim].

    `kv_ref` is the pool flattened to [pages of all layers/K-V/heads, page_size, row];
    `page_base` selects (layer, K, head), `page_base + v_offset` the matching V pages. An
    8-bit pool's rows (codes + scale, `pallas_kernels.kv_quant`) are dequantized here.
    """
    pages = tables_ref[row, pl.ds(j * pages_per_block, pages_per_block)]
    width = kv_ref.shape[-1]
    k = dequantize_kv(kv_ref[page_base + pages].reshape(-1, width))
    v = dequantize_kv(kv_ref[page_base + v_offset + pages].reshape(-1, width))
    return k, v


def online_softmax_step(carry, q, k, v, mask, v_valid, *, sm_scale: float,
                        soft_cap: float | None):
    """Folds one key block into the carry.

    Args:
        carry: (o, m, lsum) as from `init_carry`.
        q: f32[rows, D] queries.
        k: f32[block_k, D] keys.
        v: [block_k, D] values (any float dtype).
        mask: bool[rows, block_k] which (query, key) pairs attend.
        v_valid: bool[block_k, D] False for slots no query of the block sees (past the
            context, or before the window: free or null pages may hold NaN, which must
            not reach the output through 0 * NaN).
    """
    o, m, lsum = carry
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * sm_scale  # [rows, block_k]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, MASK)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    v = jnp.where(v_valid, v.astype(jnp.float32), 0.0)
    o = o * corr[:, None] + jnp.dot(p, v, preferred_element_type=jnp.float32)
    return o, m_new, lsum * corr + p.sum(axis=-1)

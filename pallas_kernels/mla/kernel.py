"""MLA over latent pages as a Pallas kernel (GPU-style: Triton, and the CPU's interpreter).

Programs run over query blocks (`block_q` tokens of one request, as the ragged kernel cuts
them: `query_blocks`); all H heads of a block's tokens share the one latent head, so a
program's rows are block_q x H (heads padded to a power of two) and it walks its request's
pages `pages_per_block` at a time with online softmax. Each latent row is read as two
column slices, c_kv [:R] and k_pe [R:], so every block shape stays a power of two for
Triton (576 = 512 + 64 is not one): scores = q_latent . c_kv + q_pe . k_pe, output
p . c_kv. Each program writes its own output block; the wrapper scatters rows back to
tokens (`scatter_rows`).

Reads float pools of the queries' dtype; 8-bit pools are refused (the XLA path reads them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.flash import MASK
from pallas_kernels.kv_quant import is_quantized
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.mla.reference import check_mla_shapes
from pallas_kernels.ragged_paged_attention.kernel import block_span, query_blocks, scatter_rows


def check_kernel_pool(pool: jax.Array) -> None:
    """Raises ValueError for pools the MLA kernels do not read (8-bit ones)."""
    if is_quantized(pool.dtype):
        raise ValueError(f"the Pallas MLA kernel reads float latent pools only, got pool dtype "
                         f"{pool.dtype}; use kv_cache_dtype='auto' or attention_backend='xla'")


def query_rows(rows: int, block_k: int, hp: int, n_valid, num_heads: int):
    """(row_tok i32[rows, block_k], row_ok bool[rows, block_k]): a query block's rows are its
    tokens x `hp` padded heads; each row's token in the block, and whether it is a real token
    (of the `n_valid`) and head (of the `num_heads`)."""
    row = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
    row_tok = row // hp
    return row_tok, (row_tok < n_valid) & (row % hp < num_heads)


def _kernel(slot_ref, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref, tables_ref,
            ql_ref, qp_ref, kv_ref, o_ref, *, num_pages, page_size, pages_per_block, num_heads,
            sm_scale):
    b = pl.program_id(0)
    block_q, hp, rank = ql_ref.shape[1], ql_ref.shape[2], ql_ref.shape[3]
    rope = qp_ref.shape[3]
    rows, block_k = block_q * hp, pages_per_block * page_size
    seq, n_valid, kv_len, first_pos, first_blk, num_blk = block_span(
        b, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref, 0, block_k)
    row_tok, row_ok = query_rows(rows, block_k, hp, n_valid, num_heads)
    q_lat = ql_ref[0].reshape(rows, rank).astype(jnp.float32)
    q_pe = qp_ref[0].reshape(rows, rope).astype(jnp.float32)
    page_base = slot_ref[0] * num_pages  # pages of the layer's slot

    def body(i, carry):
        o, m, lsum = carry
        j = first_blk + i
        pages = page_base + tables_ref[seq, pl.ds(j * pages_per_block, pages_per_block)]
        c_kv = kv_ref[pages, :, pl.ds(0, rank)].reshape(block_k, rank).astype(jnp.float32)
        k_pe = kv_ref[pages, :, pl.ds(rank, rope)].reshape(block_k, rope).astype(jnp.float32)
        s = (jnp.dot(q_lat, c_kv.T, preferred_element_type=jnp.float32)
             + jnp.dot(q_pe, k_pe.T, preferred_element_type=jnp.float32)) * sm_scale
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        mask = (k_pos < kv_len) & (k_pos <= first_pos + row_tok) & row_ok
        s = jnp.where(mask, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        # Slots past the context (free pages) may hold NaN: no 0 * NaN into the sum.
        v_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, rank), 0)
        c_kv = jnp.where(v_pos < kv_len, c_kv, 0.0)
        o = o * corr[:, None] + jnp.dot(p, c_kv, preferred_element_type=jnp.float32)
        return o, m_new, lsum * corr + p.sum(axis=-1)

    init = (jnp.zeros((rows, rank), jnp.float32), jnp.full((rows,), MASK, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, _, lsum = lax.fori_loop(0, num_blk, body, init)
    o = jnp.where(lsum[:, None] > 0, o / jnp.where(lsum > 0, lsum, 1.0)[:, None], 0.0)
    o_ref[0] = o.reshape(block_q, hp, rank).astype(o_ref.dtype)


def query_tiles(q: jax.Array, blk_start: jax.Array, block_q: int, heads: int) -> jax.Array:
    """q [T, H, D] gathered into query blocks [num_blocks, block_q, heads, D] (heads padded
    with zeros to `heads`; rows past the step's end repeat its last token, masked)."""
    num_tokens, num_heads = q.shape[:2]
    tok = jnp.minimum(blk_start[:, None] + jnp.arange(block_q, dtype=jnp.int32), num_tokens - 1)
    return jnp.pad(q, ((0, 0), (0, heads - num_heads), (0, 0)))[tok]


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "pages_per_block",
                                             "interpret"))
def mla_attention_kernel(q_latent, q_pe, pool, slot, md: AttentionMetadata, *, sm_scale,
                         block_q=8, pages_per_block=2, interpret=False):
    """Pallas MLA (Triton, or the interpreter); the contract is `mla_attention_reference`'s.

    Args:
        block_q: Query tokens per program (its rows are block_q x the padded heads).
        pages_per_block: Pages loaded per inner iteration.
        interpret: Run in the Pallas interpreter (the CPU's only option).

    Raises:
        ValueError: Shapes that do not fit (`check_mla_shapes`), or an 8-bit pool.
    """
    check_mla_shapes(q_latent, q_pe, pool, md)
    check_kernel_pool(pool)
    num_tokens, num_heads, rank = q_latent.shape
    num_slots, _, _, num_pages, page_size, width = pool.shape
    hp = pl.next_power_of_2(num_heads)
    blk_seq, blk_start, blk_len = query_blocks(md.cu_q_lens, num_tokens, block_q)
    ql = query_tiles(q_latent, blk_start, block_q, hp)  # [blocks, block_q, hp, R]
    qp = query_tiles(q_pe, blk_start, block_q, hp)  # [blocks, block_q, hp, Dr]
    width_t = md.block_tables.shape[1]
    tables = jnp.pad(md.block_tables, ((0, 0), (0, -width_t % pages_per_block)))
    kv_flat = pool.reshape(num_slots * num_pages, page_size, width)  # one latent page a row

    kernel = functools.partial(_kernel, num_pages=num_pages, page_size=page_size,
                               pages_per_block=pages_per_block, num_heads=num_heads,
                               sm_scale=sm_scale)
    whole = pl.BlockSpec()  # the whole array, indexed inside the kernel
    tile = lambda d: pl.BlockSpec((1, block_q, hp, d), lambda b: (b, 0, 0, 0))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(blk_seq.shape[0],),
        in_specs=[whole] * 7 + [tile(rank), tile(q_pe.shape[2]), whole],
        out_specs=tile(rank),
        out_shape=jax.ShapeDtypeStruct(ql.shape, q_latent.dtype),
        interpret=interpret,
        # NOTE: Triton explicitly, as the other GPU kernels (JAX would otherwise pick Mosaic
        # GPU, which stages whole-array refs such as the pool in shared memory).
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name=f"mla_attention_bq{block_q}_ppb{pages_per_block}",
    )(jnp.asarray(slot, jnp.int32).reshape(1), blk_seq, blk_start, blk_len, md.cu_q_lens,
      md.kv_lens, tables, ql, qp, kv_flat)
    out = out[:, :, :num_heads, None]  # [blocks, block_q, 1, H, R]: one "KV head" of H
    return scatter_rows(out, blk_start, blk_len, num_tokens, num_heads).astype(q_latent.dtype)

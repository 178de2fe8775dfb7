"""MLA over latent pages for TPU (Mosaic): scalar-prefetched block tables, latent-page DMAs.

Same tiling as `kernel.py` (a program per query block of one request, its rows the block's
tokens x all heads, online softmax over `pages_per_block` pages at a time), TPU-shaped: the
block tables and lengths are scalar-prefetched into SMEM, the pool stays in HBM
(`MemorySpace.ANY`) and each iteration DMAs its latent pages into VMEM. Each page is read
once and used whole: the scores are one dot of [q_latent, q_pe] with the full latent row,
and the output is p times the full row too (the wrapper keeps its first R columns; the
k_pe columns cost Dr / R more MXU work, 1/8 for DeepSeek-V3, and spare a lane slice that
is not 128-aligned for small ranks).

NOTE: pages are fetched then waited on in the same iteration, as in the ragged TPU kernel;
double-buffering is the next step, to be measured on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash import MASK
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.mla.kernel import check_kernel_pool, query_rows, query_tiles
from pallas_kernels.mla.reference import check_mla_shapes
from pallas_kernels.ragged_paged_attention.kernel import block_span, query_blocks, scatter_rows


def _kernel(slot_ref, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref, tables_ref,
            q_ref, kv_hbm, o_ref, buf, sems, *, num_pages, page_size, pages_per_block,
            table_width, num_heads, sm_scale):
    b = pl.program_id(0)
    block_q, hp, width = q_ref.shape[1], q_ref.shape[2], q_ref.shape[3]
    rows, block_k = block_q * hp, pages_per_block * page_size
    seq, n_valid, kv_len, first_pos, first_blk, num_blk = block_span(
        b, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref, 0, block_k)
    row_tok, row_ok = query_rows(rows, block_k, hp, n_valid, num_heads)
    q = q_ref[0].reshape(rows, width).astype(jnp.float32)
    page_base = slot_ref[0] * num_pages

    def body(i, carry):
        o, m, lsum = carry
        j = first_blk + i
        dmas = [pltpu.make_async_copy(
            kv_hbm.at[page_base + tables_ref[seq * table_width + j * pages_per_block + p]],
            buf.at[p], sems.at[p]) for p in range(pages_per_block)]  # static unroll
        for dma in dmas:
            dma.start()
        for dma in dmas:
            dma.wait()
        lat = buf[...].reshape(block_k, width).astype(jnp.float32)  # f32[block_k, W]
        s = lax.dot_general(q, lat, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale  # [rows, block_k]
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        mask = (k_pos < kv_len) & (k_pos <= first_pos + row_tok) & row_ok
        s = jnp.where(mask, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        corr = jnp.exp(m - m_new)
        # Slots past the context (free pages) may hold NaN: no 0 * NaN into the sum.
        v_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, width), 0)
        lat = jnp.where(v_pos < kv_len, lat, 0.0)
        o = o * corr + jnp.dot(p, lat, preferred_element_type=jnp.float32)
        return o, m_new, lsum * corr + p.sum(axis=-1, keepdims=True)

    init = (jnp.zeros((rows, width), jnp.float32), jnp.full((rows, 1), MASK, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    o, _, lsum = lax.fori_loop(0, num_blk, body, init)
    o = jnp.where(lsum > 0, o / jnp.where(lsum > 0, lsum, 1.0), 0.0)
    o_ref[0] = o.reshape(block_q, hp, width).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "pages_per_block",
                                             "interpret"))
def mla_attention_tpu(q_latent, q_pe, pool, slot, md: AttentionMetadata, *, sm_scale,
                      block_q=8, pages_per_block=2, interpret=False):
    """TPU MLA; the contract is `mla_attention_reference`'s.

    Args:
        block_q: Query tokens per program.
        pages_per_block: Latent pages DMA'd per inner iteration.
        interpret: Run under the TPU interpreter (`pltpu.InterpretParams`) on the CPU.

    Raises:
        ValueError: Shapes that do not fit (`check_mla_shapes`), or an 8-bit pool.
    """
    check_mla_shapes(q_latent, q_pe, pool, md)
    check_kernel_pool(pool)
    num_tokens, num_heads, rank = q_latent.shape
    num_slots, _, _, num_pages, page_size, width = pool.shape
    hp = 8 * pl.cdiv(num_heads, 8)  # NOTE: sublane-aligned rows per token
    blk_seq, blk_start, blk_len = query_blocks(md.cu_q_lens, num_tokens, block_q)
    q = jnp.concatenate([q_latent, q_pe], axis=-1)  # [T, H, W]
    q_blocks = query_tiles(q, blk_start, block_q, hp)  # [blocks, block_q, hp, W]
    table_width = pages_per_block * pl.cdiv(md.block_tables.shape[1], pages_per_block)
    tables = jnp.pad(md.block_tables, ((0, 0), (0, table_width - md.block_tables.shape[1])))
    kv_flat = pool.reshape(num_slots * num_pages, page_size, width)

    kernel = functools.partial(_kernel, num_pages=num_pages, page_size=page_size,
                               pages_per_block=pages_per_block, table_width=table_width,
                               num_heads=num_heads, sm_scale=sm_scale)
    tile = pl.BlockSpec((1, block_q, hp, width), lambda b, *_: (b, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(blk_seq.shape[0],),
        in_specs=[tile, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=tile,
        scratch_shapes=[pltpu.VMEM((pages_per_block, page_size, width), pool.dtype),
                        pltpu.SemaphoreType.DMA((pages_per_block,))])
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q_latent.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        name=f"mla_attention_tpu_bq{block_q}_ppb{pages_per_block}",
    )(jnp.asarray(slot, jnp.int32).reshape(1), blk_seq, blk_start, blk_len, md.cu_q_lens,
      md.kv_lens, tables.reshape(-1), q_blocks, kv_flat)
    out = out[:, :, :num_heads, None, :rank]  # [blocks, block_q, 1, H, R]
    return scatter_rows(out, blk_start, blk_len, num_tokens, num_heads).astype(q_latent.dtype)

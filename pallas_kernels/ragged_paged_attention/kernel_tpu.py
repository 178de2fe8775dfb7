"""Ragged paged attention for TPU (Mosaic): scalar-prefetched block tables, page DMAs to VMEM.

Same tiling as the GPU kernel (programs over query blocks x KV heads, online softmax over
`pages_per_block` pages at a time), but TPU-shaped: block tables and lengths are
scalar-prefetched into SMEM, the page pool stays in HBM (`MemorySpace.ANY`), and each
iteration DMAs its K and V pages into VMEM scratch before computing. It serves decode
steps too (a decode request is a block with one valid query).

NOTE: pages are fetched then waited on in the same iteration; double-buffering the next
block's pages behind the current block's compute is the obvious next tuning step, to be
measured on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash import MASK
from pallas_kernels.kv_quant import dequantize_kv
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ragged_paged_attention.kernel import (
    kernel_scalars,
    program,
    query_blocks,
    scatter_rows,
    sink_rows,
    value_slots,
)
from pallas_kernels.ragged_paged_attention.reference import check_shapes, chunk_start
from pallas_kernels.sinks import check_sinks, sink_factor


def _kernel(scalars_ref, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref,
            tables_ref, q_ref, kv_hbm, *refs, num_pages, num_kv_heads, page_size,
            pages_per_block, table_width, group, sm_scale, soft_cap, chunked):
    # refs: sinks_ref f32[1, rows, 1] of this KV head (with sinks only), o_ref, scratch
    sinks_ref, (o_ref, k_buf, v_buf, sems) = (
        (refs[0], refs[1:]) if len(refs) == 5 else (None, refs))
    (h, layer, window, chunk, block_q, gp, head_dim, rows, block_k, seq, n_valid, kv_len,
     first_pos, first_blk, num_blk) = program(scalars_ref, blk_seq_ref, blk_start_ref,
                                              blk_len_ref, cu_ref, kv_lens_ref, q_ref,
                                              page_size, pages_per_block, chunked)
    row_tok = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) // gp
    row_head = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) % gp
    row_pos = first_pos + row_tok  # i32[rows, block_k]
    row_ok = (row_tok < n_valid) & (row_head < group)
    # i32[rows, block_k]: each row's chunk start, once per program (the remainder by a traced
    # chunk stays out of the key loop)
    row_lo = None if chunk is None else chunk_start(row_pos, chunk)

    q = q_ref[0, :, 0, :, :].reshape(rows, head_dim).astype(jnp.float32)
    k_base = (layer * 2 * num_kv_heads + h) * num_pages
    v_base = k_base + num_kv_heads * num_pages

    def copies(j):
        out = []
        for p in range(pages_per_block):  # static unroll: one DMA per page, K and V
            page = tables_ref[seq * table_width + j * pages_per_block + p]
            out.append(pltpu.make_async_copy(kv_hbm.at[k_base + page], k_buf.at[p], sems.at[0, p]))
            out.append(pltpu.make_async_copy(kv_hbm.at[v_base + page], v_buf.at[p], sems.at[1, p]))
        return out

    def body(i, carry):
        o, m, lsum = carry
        j = first_blk + i
        dmas = copies(j)
        for dma in dmas:
            dma.start()
        for dma in dmas:
            dma.wait()
        k = dequantize_kv(k_buf[...].reshape(block_k, k_buf.shape[-1]))  # f32[block_k, D]
        v = dequantize_kv(v_buf[...].reshape(block_k, v_buf.shape[-1]))
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale  # [rows, block_k]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        mask = (k_pos < kv_len) & (k_pos <= row_pos) & row_ok
        mask &= (window <= 0) | (row_pos - k_pos < window)
        if row_lo is not None:
            mask &= k_pos >= row_lo
        s = jnp.where(mask, s, MASK)
        m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        corr = jnp.exp(m - m_new)
        v_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
        # NaN past kv_len or before the window must not leak via 0 * NaN
        v = jnp.where(value_slots(v_pos, kv_len, first_pos, window, chunk), v, 0.0)
        o = o * corr + jnp.dot(p, v, preferred_element_type=jnp.float32)
        return o, m_new, lsum * corr + p.sum(axis=-1, keepdims=True)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), MASK, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    o, m, lsum = lax.fori_loop(0, num_blk, body, init)
    o = jnp.where(lsum > 0, o / jnp.where(lsum > 0, lsum, 1.0), 0.0)
    if sinks_ref is not None:  # [rows, 1], as m and lsum: no relayout
        o = o * sink_factor(m, lsum, sinks_ref[0])
    o_ref[0, :, 0, :, :] = o.reshape(block_q, gp, head_dim).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "block_q",
                                             "pages_per_block", "interpret"))
def ragged_paged_attention_tpu(q, kv_pages, layer, md: AttentionMetadata, *, sm_scale,
                               sliding_window=0, soft_cap=None, sinks=None, block_q=16,
                               pages_per_block=2, interpret=False, chunk_size=None):
    """TPU ragged paged attention; same contract as `ragged_paged_attention_reference`.

    Args:
        chunk_size: Chunked local attention (Llama 4; may be traced; <= 0 at run time:
            none), a third prefetched scalar, as in `ragged_paged_attention_kernel`; None:
            the program has no chunk (unchanged).
        sinks: f32[num_q_heads] sink logits or None; with them each program reads its KV
            head's rows of sinks (f32[rows, 1], the layout of its running max) as one more
            VMEM block and scales its outputs after the last key block.
        block_q: Query tokens per program.
        pages_per_block: Pages DMA'd per inner iteration.
        interpret: Run under the TPU interpreter (`pltpu.InterpretParams`) on the CPU.
    """
    check_shapes(q, kv_pages, md)
    check_sinks(sinks, q.shape[1])
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_pages, page_size, _ = kv_pages.shape
    group = num_q_heads // num_kv_heads
    gp = 8 * pl.cdiv(group, 8)  # NOTE: sublane-aligned rows per KV head

    blk_seq, blk_start, blk_len = query_blocks(md.cu_q_lens, num_tokens, block_q)
    tok = jnp.minimum(blk_start[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None],
                      num_tokens - 1)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_blocks = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))[tok]
    width = md.block_tables.shape[1]
    width_padded = pages_per_block * pl.cdiv(width, pages_per_block)
    tables = jnp.pad(md.block_tables, ((0, 0), (0, width_padded - width))).reshape(-1)
    kv_flat = kv_pages.reshape(num_layers * 2 * num_kv_heads * num_pages, page_size,
                               kv_pages.shape[-1])  # rows: head_dim (+ scale if 8-bit)
    scalars = kernel_scalars(layer, sliding_window, chunk_size)

    kernel = functools.partial(
        _kernel, num_pages=num_pages, num_kv_heads=num_kv_heads, page_size=page_size,
        pages_per_block=pages_per_block, table_width=width_padded, group=group,
        sm_scale=sm_scale, soft_cap=soft_cap, chunked=chunk_size is not None)
    block = pl.BlockSpec((1, block_q, 1, gp, head_dim), lambda b, h, *_: (b, 0, h, 0, 0))
    extra, extra_specs = (), []
    if sinks is not None:  # f32[Hkv, rows, 1]: the last two axes whole, as Mosaic wants
        extra = (sink_rows(sinks, num_kv_heads, gp, block_q)[..., None],)
        extra_specs = [pl.BlockSpec((1, block_q * gp, 1), lambda b, h, *_: (h, 0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(blk_seq.shape[0], num_kv_heads),
        in_specs=[block, pl.BlockSpec(memory_space=pl.ANY)] + extra_specs,
        out_specs=block,
        scratch_shapes=[pltpu.VMEM((pages_per_block, page_size, kv_pages.shape[-1]),
                                   kv_pages.dtype),
                        pltpu.VMEM((pages_per_block, page_size, kv_pages.shape[-1]),
                                   kv_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, pages_per_block))])
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary")),
        name=f"ragged_paged_attention_tpu_bq{block_q}_ppb{pages_per_block}",
    )(scalars, blk_seq, blk_start, blk_len, md.cu_q_lens, md.kv_lens, tables, q_blocks,
      kv_flat, *extra)
    return scatter_rows(out, blk_start, blk_len, num_tokens, group).astype(q.dtype)

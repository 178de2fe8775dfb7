"""Paged decode attention as a Pallas kernel: grid (request, KV head, context split).

Each program runs online softmax over one split of a request's pages, `pages_per_block`
pages per iteration, for all query heads sharing its KV head. Splitting long contexts
across `num_splits` programs keeps the GPU busy at small batch; the partial results are
combined with a log-sum-exp in the wrapper.

NOTE: generic Pallas (interpret mode on CPU, Triton on GPU); see the ragged kernel's note.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.flash import init_carry, load_pages, online_softmax_step
from pallas_kernels.paged_decode_attention.reference import check_decode_shapes
from pallas_kernels.ragged_paged_attention.reference import chunk_start
from pallas_kernels.sinks import check_sinks, grouped_sinks, sink_factor


def _kernel(scalars_ref, kv_lens_ref, tables_ref, q_ref, kv_ref, o_ref, m_ref, l_ref, *,
            num_pages, num_kv_heads, page_size, pages_per_block, pages_per_split, group,
            sm_scale, soft_cap, chunked):
    s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window = scalars_ref[0], scalars_ref[1]
    gp, head_dim = q_ref.shape[2], q_ref.shape[3]
    block_k = pages_per_block * page_size
    kv_len = kv_lens_ref[s]
    q_pos = kv_len - 1
    q = q_ref[0, 0].astype(jnp.float32)  # [gp, head_dim]
    head_ok = lax.broadcasted_iota(jnp.int32, (gp, block_k), 0) < group

    lo = jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)
    if chunked:  # the query's chunk: keys before it are skipped and masked like the window's
        lo = jnp.maximum(lo, chunk_start(q_pos, scalars_ref[2]))
    first_blk = jnp.maximum(split * pages_per_split * page_size, lo) // block_k
    end = jnp.minimum((split + 1) * pages_per_split * page_size, kv_len)
    num_blk = jnp.maximum(pl.cdiv(end, block_k) - first_blk, 0)
    page_base = (layer * 2 * num_kv_heads + h) * num_pages
    v_offset = num_kv_heads * num_pages

    def body(i, carry):
        j = first_blk + i
        k, v = load_pages(kv_ref, tables_ref, s, j, page_base, v_offset, pages_per_block,
                          head_dim)
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (gp, block_k), 1)
        mask = (k_pos < end) & (k_pos >= split * pages_per_split * page_size) & head_ok
        mask &= (window <= 0) | (q_pos - k_pos < window)
        if chunked:
            mask &= k_pos >= lo
        v_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
        # NOTE: values before the window or chunk (a sliding or chunked group's given-back
        # null pages) and past the context are zeroed: they may hold NaN.
        return online_softmax_step(carry, q, k, v, mask, (v_pos < kv_len) & (v_pos >= lo),
                                   sm_scale=sm_scale, soft_cap=soft_cap)

    init = init_carry(gp, head_dim)
    o, m, lsum = lax.fori_loop(0, num_blk, body, init)
    o_ref[0, 0, 0] = o
    m_ref[0, 0, 0] = m
    l_ref[0, 0, 0] = lsum


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "pages_per_block",
                                             "num_splits", "interpret"))
def paged_decode_attention_kernel(q, kv_pages, layer, block_tables, kv_lens, *, sm_scale,
                                  sliding_window=0, soft_cap=None, sinks=None,
                                  pages_per_block=2, num_splits=2, interpret=False,
                                  chunk_size=None):
    """Pallas decode attention; same contract as `paged_decode_attention_reference`.

    Args:
        chunk_size: Chunked local attention (Llama 4; may be traced; <= 0 at run time:
            none): the query at kv_len - 1 sees keys from its chunk's start (the ragged
            reference's `chunk_ok`), a third kernel scalar. None: no chunk (the program is
            unchanged).
        sinks: f32[num_q_heads] sink logits (`pallas_kernels.sinks`; the ragged reference's
            semantics), applied in the wrapper to the splits' combined state: the kernel
            is the same program with or without them. None: no sinks.
        pages_per_block: Pages per inner iteration (block_k = pages * page_size).
        num_splits: Programs sharing one request's context (split-K), combined by LSE.
        interpret: Run in the Pallas interpreter (the CPU's only option).
    """
    check_decode_shapes(q, kv_pages, block_tables, kv_lens)
    check_sinks(sinks, q.shape[1])
    num_seqs, num_q_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_pages, page_size, _ = kv_pages.shape
    group = num_q_heads // num_kv_heads
    # NOTE: Triton's dot needs >= 16 rows; the interpreter is faster without the padding.
    gp = pl.next_power_of_2(group) if interpret else max(16, pl.next_power_of_2(group))
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))

    width = block_tables.shape[1]
    pages_per_split = pl.cdiv(pl.cdiv(width, num_splits), pages_per_block) * pages_per_block
    tables = jnp.pad(block_tables, ((0, 0), (0, pages_per_split * num_splits - width)))
    kv_flat = kv_pages.reshape(num_layers * 2 * num_kv_heads * num_pages, page_size,
                               kv_pages.shape[-1])  # rows: head_dim (+ scale if 8-bit)
    scalars = jnp.stack([jnp.asarray(x, jnp.int32) for x in (layer, sliding_window)
                         + (() if chunk_size is None else (chunk_size,))])

    kernel = functools.partial(
        _kernel, num_pages=num_pages, num_kv_heads=num_kv_heads, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_split=pages_per_split, group=group,
        sm_scale=sm_scale, soft_cap=soft_cap, chunked=chunk_size is not None)
    whole = pl.BlockSpec()
    part = (num_seqs, num_kv_heads, num_splits, gp)
    o, m, lsum = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[whole, whole, whole,
                  pl.BlockSpec((1, 1, gp, head_dim), lambda s, h, c: (s, h, 0, 0)), whole],
        out_specs=[pl.BlockSpec((1, 1, 1, gp, head_dim), lambda s, h, c: (s, h, c, 0, 0)),
                   pl.BlockSpec((1, 1, 1, gp), lambda s, h, c: (s, h, c, 0)),
                   pl.BlockSpec((1, 1, 1, gp), lambda s, h, c: (s, h, c, 0))],
        out_shape=[jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)],
        interpret=interpret,
        # NOTE: Triton explicitly; JAX 0.10 would otherwise pick Mosaic GPU, which stages
        # whole-array refs (the page pool) in shared memory.
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name=f"paged_decode_attention_ppb{pages_per_block}_splits{num_splits}",
    )(scalars, kv_lens, tables, qg, kv_flat)

    # Log-sum-exp combine of the splits.
    m_all = m.max(axis=2, keepdims=True)  # [num_seqs, Hkv, 1, gp]
    scale = jnp.where(lsum > 0, jnp.exp(m - m_all), 0.0)  # [num_seqs, Hkv, splits, gp]
    num = jnp.sum(o * scale[..., None], axis=2)  # [num_seqs, Hkv, gp, head_dim]
    den = jnp.sum(lsum * scale, axis=2)[..., None]
    out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    if sinks is not None:  # [Hkv, gp] sinks (padded heads' outputs are dropped below)
        sk = jnp.pad(grouped_sinks(sinks, num_kv_heads), ((0, 0), (0, gp - group)))
        out = out * sink_factor(m_all[:, :, 0], den[..., 0], sk)[..., None]
    out = out[:, :, :group]
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)

"""Ragged paged attention as a Pallas kernel (GPU-style: grid of query blocks x KV heads).

The wrapper cuts each request's queries into blocks of `block_q` tokens (a request's
queries never share a block with another's), gathers them to `[num_blocks, ...]`, and
the kernel runs flash-attention (online softmax) over that request's pages, `pages_per_block`
pages at a time, reading them through the block table. Each program writes its own output
block, so no two programs touch the same memory; the wrapper scatters rows back to tokens.

NOTE: written against the generic Pallas API (refs, `pl.ds`, `lax.fori_loop`), which the
CPU runs with `interpret=True` and the GPU lowers through Triton. Keep GPU specifics in
this file so a Mosaic GPU version can replace it behind `pallas_kernels.ops`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.flash import init_carry, load_pages, online_softmax_step
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ragged_paged_attention.reference import check_shapes, chunk_start
from pallas_kernels.sinks import check_sinks, grouped_sinks, sink_factor


def query_blocks(cu_q_lens: jax.Array, num_tokens: int, block_q: int):
    """Splits each request's query tokens into blocks of at most `block_q` tokens.

    Returns:
        blk_seq: i32[num_blocks] request of each block (num_seqs for unused blocks).
        blk_start: i32[num_blocks] first token of each block on the packed axis.
        blk_len: i32[num_blocks] valid tokens in each block (0 for unused blocks).
    """
    num_seqs = cu_q_lens.shape[0] - 1
    num_blocks = num_tokens // block_q + num_seqs  # static upper bound
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # i32[num_seqs]
    seq_blocks = (q_lens + block_q - 1) // block_q  # i32[num_seqs]
    cu_blocks = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(seq_blocks)])
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    blk_seq = jnp.searchsorted(cu_blocks[1:], b, side="right").astype(jnp.int32)
    used = blk_seq < num_seqs
    seq = jnp.minimum(blk_seq, num_seqs - 1)
    offset = (b - cu_blocks[seq]) * block_q  # first query index within the request
    blk_start = cu_q_lens[seq] + offset
    blk_len = jnp.where(used, jnp.clip(q_lens[seq] - offset, 0, block_q), 0)
    return jnp.where(used, blk_seq, num_seqs), blk_start, blk_len


def block_span(b, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref, window,
               block_k: int, chunk=None):
    """Scalars of query block `b`: (request, valid queries, context length, position of
    its first query, first key block, number of key blocks to visit). Key blocks wholly
    before the window or the attention chunk (`chunk`, None: none) of the block's first
    query (the block's earliest) are skipped."""
    seq = jnp.minimum(blk_seq_ref[b], kv_lens_ref.shape[0] - 1)
    n_valid = blk_len_ref[b]
    kv_len = kv_lens_ref[seq]
    q_len = cu_ref[seq + 1] - cu_ref[seq]
    first_pos = kv_len - q_len + (blk_start_ref[b] - cu_ref[seq])
    last_pos = jnp.minimum(first_pos + n_valid, kv_len)  # keys in [lo, last_pos)
    lo = jnp.where(window > 0, jnp.maximum(first_pos - window + 1, 0), 0)
    if chunk is not None:
        lo = jnp.maximum(lo, chunk_start(first_pos, chunk))
    first_blk = lo // block_k
    num_blk = jnp.where(n_valid > 0, pl.cdiv(last_pos, block_k) - first_blk, 0)
    return seq, n_valid, kv_len, first_pos, first_blk, num_blk


def value_slots(v_pos, kv_len, first_pos, window, chunk=None):
    """bool (v_pos's shape): value slots some query of the block sees, from the window (and
    the attention chunk, `chunk`; None: none) of its first query up to the context's end.
    Others are zeroed before `p @ v`: free pages past the context and a sliding or chunked
    KV cache group's given-back (null) pages before the window may hold anything, NaN
    included."""
    ok = (v_pos < kv_len) & ((window <= 0) | (first_pos - v_pos < window))
    return ok if chunk is None else ok & (v_pos >= chunk_start(first_pos, chunk))


class Program(NamedTuple):
    """What one (query block, KV head) program of a ragged kernel works on."""

    h: jax.Array  # KV head
    layer: jax.Array
    window: jax.Array
    chunk: jax.Array | None  # attention chunk (None: the program has none)
    block_q: int
    gp: int  # padded query heads per KV head
    head_dim: int
    rows: int  # block_q * gp
    block_k: int  # keys per block
    seq: jax.Array
    n_valid: jax.Array
    kv_len: jax.Array
    first_pos: jax.Array
    first_blk: jax.Array
    num_blk: jax.Array


def program(scalars_ref, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref, q_ref,
            page_size: int, pages_per_block: int, chunked: bool = False) -> Program:
    """The scalars of this program (shared by the GPU and TPU ragged kernels): `scalars_ref`
    holds (layer, window) and, when `chunked`, the attention chunk."""
    b, h = pl.program_id(0), pl.program_id(1)
    layer, window = scalars_ref[0], scalars_ref[1]
    chunk = scalars_ref[2] if chunked else None
    block_q, gp, head_dim = q_ref.shape[1], q_ref.shape[3], q_ref.shape[4]
    block_k = pages_per_block * page_size
    span = block_span(b, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref, window,
                      block_k, chunk)
    return Program(h, layer, window, chunk, block_q, gp, head_dim, block_q * gp, block_k, *span)


def kernel_scalars(layer, sliding_window, chunk_size) -> jax.Array:
    """i32[2] (layer, window), or i32[3] with the attention chunk when `chunk_size` is not
    None: the ragged kernels' first input."""
    parts = [layer, sliding_window] + ([] if chunk_size is None else [chunk_size])
    return jnp.stack([jnp.asarray(x, jnp.int32) for x in parts])


def _kernel(scalars_ref, blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, kv_lens_ref,
            tables_ref, q_ref, kv_ref, *refs, num_pages, num_kv_heads, page_size,
            pages_per_block, group, sm_scale, soft_cap, chunked, spans, sinks):
    # refs: (span_ref i32[1, block_q] if spans, sinks_ref f32[1, rows] of this KV head if
    # sinks, o_ref)
    refs = list(refs)
    span_ref = refs.pop(0) if spans else None
    sinks_ref = refs.pop(0) if sinks else None
    (o_ref,) = refs
    (h, layer, window, chunk, block_q, gp, head_dim, rows, block_k, seq, n_valid, kv_len,
     first_pos, first_blk, num_blk) = program(scalars_ref, blk_seq_ref, blk_start_ref,
                                              blk_len_ref, cu_ref, kv_lens_ref, q_ref,
                                              page_size, pages_per_block, chunked)
    row_tok = lax.broadcasted_iota(jnp.int32, (block_q, gp), 0).reshape(rows)
    row_head = lax.broadcasted_iota(jnp.int32, (block_q, gp), 1).reshape(rows)
    row_pos = first_pos + row_tok  # i32[rows]
    row_ok = (row_tok < n_valid) & (row_head < group)
    row_hi = row_pos  # i32[rows]: the last key each row sees
    if span_ref is not None:  # bidirectional spans: a row also sees its span's later keys
        ends = jnp.broadcast_to(span_ref[0, :][:, None], (block_q, gp)).reshape(rows)
        row_hi = jnp.maximum(row_pos, ends - 1)
        last = jnp.minimum(jnp.max(jnp.where(row_ok, row_hi, -1)) + 1, kv_len)
        num_blk = jnp.where(n_valid > 0, pl.cdiv(last, block_k) - first_blk, 0)
    # i32[rows]: each row's chunk start, once per program (a chunk boundary may fall inside
    # the block: its later rows start later)
    row_lo = None if chunk is None else chunk_start(row_pos, chunk)

    q = q_ref[0, :, 0, :, :].reshape(rows, head_dim).astype(jnp.float32)
    page_base = (layer * 2 * num_kv_heads + h) * num_pages  # K pages of (layer, head)
    v_offset = num_kv_heads * num_pages

    def body(i, carry):
        j = first_blk + i
        k, v = load_pages(kv_ref, tables_ref, seq, j, page_base, v_offset, pages_per_block,
                          head_dim)
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        mask = (k_pos < kv_len) & (k_pos <= row_hi[:, None]) & row_ok[:, None]
        mask &= (window <= 0) | (row_pos[:, None] - k_pos < window)
        if row_lo is not None:
            mask &= k_pos >= row_lo[:, None]
        v_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
        return online_softmax_step(carry, q, k, v, mask, value_slots(v_pos, kv_len, first_pos,
                                                                     window, chunk),
                                   sm_scale=sm_scale, soft_cap=soft_cap)

    init = init_carry(rows, head_dim)
    o, m, lsum = lax.fori_loop(0, num_blk, body, init)
    o = jnp.where(lsum[:, None] > 0, o / jnp.where(lsum > 0, lsum, 1.0)[:, None], 0.0)
    if sinks_ref is not None:
        o = o * sink_factor(m, lsum, sinks_ref[0])[:, None]
    o_ref[0, :, 0, :, :] = o.reshape(block_q, gp, head_dim).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "block_q",
                                             "pages_per_block", "interpret"))
def ragged_paged_attention_kernel(q, kv_pages, layer, md: AttentionMetadata, *, sm_scale,
                                  sliding_window=0, soft_cap=None, sinks=None, block_q=16,
                                  pages_per_block=2, interpret=False, chunk_size=None):
    """Pallas ragged paged attention; same contract as `ragged_paged_attention_reference`.

    Args:
        chunk_size: Chunked local attention (Llama 4; may be traced; <= 0 at run time:
            none): a third kernel scalar; each program skips key blocks before its first
            query's chunk and masks each row from its own chunk's start. None: the program
            has no chunk (unchanged).
        md: With `q_span_end` (bidirectional spans) each program also reads its queries'
            span ends and visits key blocks up to the furthest of them.
        sinks: f32[num_q_heads] sink logits or None; with them each program also reads
            its KV head's row of `sink_rows` and scales its outputs once, after the
            last key block (the program without sinks is unchanged).
        block_q: Query tokens per program.
        pages_per_block: Pages loaded per inner iteration (block_k = pages * page_size).
        interpret: Run the kernel in the Pallas interpreter (the CPU's only option).
    """
    check_shapes(q, kv_pages, md)
    check_sinks(sinks, q.shape[1])
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_pages, page_size, _ = kv_pages.shape
    group = num_q_heads // num_kv_heads
    gp = pl.next_power_of_2(group)  # pad heads per KV head to a power of two

    blk_seq, blk_start, blk_len = query_blocks(md.cu_q_lens, num_tokens, block_q)
    num_blocks = blk_seq.shape[0]
    tok = blk_start[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None]  # [blocks, block_q]
    tok = jnp.minimum(tok, num_tokens - 1)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    q_blocks = qg[tok]  # [num_blocks, block_q, num_kv_heads, gp, head_dim]

    width = md.block_tables.shape[1]
    tables = jnp.pad(md.block_tables, ((0, 0), (0, -width % pages_per_block)))
    kv_flat = kv_pages.reshape(num_layers * 2 * num_kv_heads * num_pages, page_size,
                               kv_pages.shape[-1])  # rows: head_dim (+ scale if 8-bit)
    scalars = kernel_scalars(layer, sliding_window, chunk_size)

    kernel = functools.partial(
        _kernel, num_pages=num_pages, num_kv_heads=num_kv_heads, page_size=page_size,
        pages_per_block=pages_per_block, group=group, sm_scale=sm_scale, soft_cap=soft_cap,
        chunked=chunk_size is not None, spans=md.q_span_end is not None,
        sinks=sinks is not None)
    whole = pl.BlockSpec()  # the whole array, indexed inside the kernel
    block = pl.BlockSpec((1, block_q, 1, gp, head_dim), lambda b, h: (b, 0, h, 0, 0))
    extra, extra_specs = (), []
    if md.q_span_end is not None:  # i32[num_blocks, block_q]: each query's span end
        valid = jnp.arange(block_q, dtype=jnp.int32)[None] < blk_len[:, None]
        extra = (jnp.where(valid, md.q_span_end[tok], 0),)
        extra_specs = [pl.BlockSpec((1, block_q), lambda b, h: (b, 0))]
    if sinks is not None:  # f32[Hkv, block_q * gp]: row r of a program is head r % gp
        extra += (sink_rows(sinks, num_kv_heads, gp, block_q),)
        extra_specs += [pl.BlockSpec((1, block_q * gp), lambda b, h: (h, 0))]
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads),
        in_specs=[whole] * 7 + [block, whole] + extra_specs,
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q.dtype),
        interpret=interpret,
        # NOTE: Triton explicitly; JAX 0.10 would otherwise pick Mosaic GPU, which stages
        # whole-array refs (the page pool) in shared memory.
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name=f"ragged_paged_attention_bq{block_q}_ppb{pages_per_block}",
    )(scalars, blk_seq, blk_start, blk_len, md.cu_q_lens, md.kv_lens, tables, q_blocks,
      kv_flat, *extra)

    return scatter_rows(out, blk_start, blk_len, num_tokens, group).astype(q.dtype)


def sink_rows(sinks: jax.Array, num_kv_heads: int, gp: int, block_q: int) -> jax.Array:
    """Sinks f32[Hq] laid out as a ragged program's rows: f32[num_kv_heads, block_q * gp]
    (query token major, then its `gp` padded heads; padded heads get 0, their rows are
    dropped)."""
    sk = grouped_sinks(sinks, num_kv_heads)  # f32[Hkv, group]
    sk = jnp.pad(sk, ((0, 0), (0, gp - sk.shape[1])))  # f32[Hkv, gp]
    return jnp.tile(sk, (1, block_q))


def scatter_rows(out: jax.Array, blk_start: jax.Array, blk_len: jax.Array, num_tokens: int,
                 group: int) -> jax.Array:
    """Block outputs [num_blocks, block_q, Hkv, gp, D] back to tokens [num_tokens, Hq, D].

    Token t sits in the one block that holds it; padded tokens (in no block) get zeros.
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    holds = (t[:, None] >= blk_start[None]) & (t[:, None] < blk_start + blk_len)
    blk_of_t = jnp.argmax(holds, axis=1)
    rows = out[blk_of_t, t - blk_start[blk_of_t]]  # [num_tokens, Hkv, gp, D]
    rows = jnp.where(holds.any(axis=1)[:, None, None, None], rows[:, :, :group], 0)
    return rows.reshape(num_tokens, -1, out.shape[-1])

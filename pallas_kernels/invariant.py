"""Batch-invariant building blocks: matmuls in fixed row tiles and per-token attention in
fixed key blocks, so a row's result never depends on what else shares its step.

XLA:CPU's dot picks its blocking (and so each output's accumulation order) from the
operands' shapes: a row of `x @ w` computed among 1 row and among 64 rows differs in the
last bits. `row_tiled` runs any row-wise function over fixed tiles of `tile` rows (a
loop, so every row goes through one compiled kernel of one shape, wherever it sits in
the step and whatever the bucket). `invariant_attention` gives every query token its own
online softmax over its request's keys [0, position] in blocks of a fixed size, tokens in
fixed tiles too: a token's arithmetic is the same whether it is a decode, part of a
prefill chunk of any length, or recomputed after preemption. Blocks past a token's own
length are fully masked, which leaves its state bit-for-bit unchanged (scale exp(0) = 1,
added terms exact zeros), so a tile's trip count (its longest token) changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ragged_paged_attention.reference import (
    causal_limit,
    chunk_start,
    token_positions,
)
from pallas_kernels.ragged_paged_attention.xla import _tiles_by_head
from pallas_kernels.sinks import check_sinks, grouped_sinks, sink_factor

_NEG = -1e30  # running max of a row that has seen no key yet (exp(_NEG - m) == 0)


def fixed_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in one fixed order (a halving tree of elementwise adds over
    the axis padded with zeros to a power of two), keepdims: XLA's reductions pick their
    vectorization, and so their order, from the fusion they land in, which follows the
    step's shape; elementwise adds are exact-rounded whatever the code around them."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    x = jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - n),))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def tile_loop(fn: Callable, xs, num_rows: int, tile: int):
    """`fn` over fixed tiles of `tile` rows of the arrays `xs` ([num_rows, ...] each, the
    last tile padded with copies of the last row), results stacked back to [num_rows, ...].

    NOTE: the loop's trip count and the padded inputs pass an `optimization_barrier`, so
    XLA neither knows the count (a loop of one tile would be inlined) nor fuses the
    inputs' producers (shaped by the step) into the body: either changed the body's
    code, and the last bits of its results, with the step's size. Padding with copies of
    a real row rather than zeros: all-zero query rows in the attention's last tile changed
    the other tokens' results in the last bits inside a full model step (zero request ids,
    positions or lengths did not), though not in the attention alone; the cause was not
    found (the step's own padded tokens carry real values).
    """
    n = -(-num_rows // tile)
    xs = jax.tree.map(lambda x: jnp.pad(x, ((0, n * tile - num_rows),)
                                        + ((0, 0),) * (x.ndim - 1), mode="edge"), xs)
    xs = jax.lax.optimization_barrier(xs)
    first = jax.tree.map(lambda x: x[:tile], xs)
    shapes = jax.eval_shape(fn, first)
    out = jax.tree.map(lambda s: jnp.zeros((n * tile,) + s.shape[1:], s.dtype), shapes)

    def body(i, out):
        part = fn(jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * tile, tile), xs))
        return jax.tree.map(lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, i * tile, 0),
                            out, part)

    count = jax.lax.optimization_barrier(jnp.int32(n))
    out = jax.lax.fori_loop(0, count, body, out)
    return jax.tree.map(lambda o: o[:num_rows], out)


def row_tiled(fn: Callable[[jax.Array], jax.Array], x: jax.Array, tile: int) -> jax.Array:
    """`fn` applied to x [T, ...] in tiles of `tile` rows (`tile_loop`), so its compiled
    kernel has one shape, in a loop of its own, whatever T is.

    Args:
        fn: A row-wise function [tile, ...] -> [tile, ...] (rows must not interact).
        x: [T, ...] rows.
        tile: Rows per tile; 0 applies `fn` to x whole.

    Returns:
        fn's rows for x's T rows.
    """
    if tile <= 0:
        return fn(x)
    return tile_loop(fn, x, x.shape[0], tile)


def invariant_attention(q: jax.Array, kv_pages: jax.Array, layer, md: AttentionMetadata, *,
                        sm_scale: float, sliding_window=0, soft_cap: float | None = None,
                        sinks: jax.Array | None = None, block_kv: int = 64,
                        token_tile: int = 16, chunk_size=0) -> jax.Array:
    """Causal paged attention, every token alone: keys [0, position] of its request in
    blocks of `block_kv`, tokens in tiles of `token_tile`; the result of a token depends on
    its query, position and its request's K/V only.

    Args:
        q: [num_tokens, num_q_heads, head_dim] queries (rotary applied); this step's K/V
            are already in the pool.
        kv_pages: dtype[num_layers, 2, num_kv_heads, num_pages, page_size, head_dim].
        layer: Layer index into the pool (may be traced).
        md: The step's metadata.
        sm_scale: Scale applied to q.k.
        sliding_window: Keys older than `window` positions are masked; 0 means none.
        soft_cap: If set, logits become `soft_cap * tanh(logits / soft_cap)`.
        sinks: f32[num_q_heads] sink logits (`pallas_kernels.sinks`), applied per token
            after its last key block (elementwise: the token's result still depends on its
            own state only); None: no sinks.
        block_kv: Keys per block (rounded to whole pages).
        token_tile: Query tokens per tile.
        chunk_size: Chunked local attention (Llama 4; may be traced; 0: none): a token sees
            keys from floor(p / C) * C on. A tile's loop starts at the block of its
            earliest chunk start: the blocks skipped are wholly masked for every token of
            the tile, which would leave its state unchanged, so results stay invariant.

    Returns:
        [num_tokens, num_q_heads, head_dim] in q's dtype; padded tokens are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    check_sinks(sinks, num_q_heads)
    _, _, kv_heads, _, page_size, _ = kv_pages.shape
    group = num_q_heads // kv_heads
    ppb = max(1, block_kv // page_size)
    block_kv = ppb * page_size
    window = jnp.asarray(sliding_window, jnp.int32)
    seq_ids, q_pos, valid = token_positions(md, num_tokens)
    # i32[T] keys each token reads: through its position, or its bidirectional span's end
    lens = jnp.where(valid, causal_limit(md, q_pos) + 1, 0)
    # Static: without a chunk the program is unchanged (no starts through the loop's barrier)
    chunked = not (isinstance(chunk_size, int) and chunk_size == 0)
    tables = md.block_tables  # i32[R, W]
    pad = (-tables.shape[1]) % ppb
    if pad:
        tables = jnp.pad(tables, ((0, 0), (0, pad)))  # page 0 is masked
    qg = q.astype(jnp.float32).reshape(num_tokens, kv_heads, group, head_dim)

    def one_tile(args):
        qt, seq, pos, ln = args[:4]  # [t, k, g, d], i32[t] x3
        lo = args[4] if chunked else None  # i32[t] each token's first key
        table = tables[seq]  # i32[t, W]

        def block(b, state):
            acc, m, denom = state  # [t, k, g, d], [t, k, g], [t, k, g]
            ids = jax.lax.dynamic_slice_in_dim(table, b * ppb, ppb, axis=1)  # i32[t, ppb]
            # [k, t, block_kv, d] (gathered head-major, f32)
            k = _tiles_by_head(kv_pages, layer, ids, 0).reshape(kv_heads, -1, block_kv, head_dim)
            v = _tiles_by_head(kv_pages, layer, ids, 1).reshape(kv_heads, -1, block_kv, head_dim)
            k_pos = b * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # i32[C]
            mask = ((k_pos[None, :] < ln[:, None])
                    & ((window <= 0) | (pos[:, None] - k_pos[None, :] < window)))  # [t, C]
            if lo is not None:
                mask &= k_pos[None, :] >= lo[:, None]
            logits = jnp.einsum("tkgd,ktcd->tkgc", qt, k) * sm_scale  # [t, k, g, C]
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            p = jnp.exp(logits - m_new[..., None])  # [t, k, g, C]
            scale = jnp.exp(m - m_new)
            v = jnp.where(mask[None, :, :, None], v, 0.0)  # NaN in free slots stays out
            acc = acc * scale[..., None] + jnp.einsum("tkgc,ktcd->tkgd", p, v)
            return acc, m_new, denom * scale + jnp.sum(p, axis=-1)

        t = qt.shape[0]
        init = (jnp.zeros((t, kv_heads, group, head_dim), jnp.float32),
                jnp.full((t, kv_heads, group), _NEG, jnp.float32),
                jnp.zeros((t, kv_heads, group), jnp.float32))
        num_blocks = (jnp.max(ln) + block_kv - 1) // block_kv
        first = 0 if lo is None else jnp.min(lo) // block_kv
        acc, m, denom = jax.lax.fori_loop(first, num_blocks, block, init)
        out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
        if sinks is not None:  # [t, k, g] factor of each token's rows
            out = out * sink_factor(m, denom, grouped_sinks(sinks, kv_heads))[..., None]
        return out

    xs = (qg, seq_ids, q_pos, lens) + ((chunk_start(q_pos, chunk_size),) if chunked else ())
    out = tile_loop(one_tile, xs, num_tokens, token_tile)
    out = out.reshape(num_tokens, num_q_heads, head_dim)
    out = jnp.where(valid[:, None, None], out, 0.0)
    return out.astype(q.dtype)


def invariant_attention_cpu(q: jax.Array, kv_pages: jax.Array, layer, md: AttentionMetadata, *,
                            sm_scale: float, sliding_window=0, soft_cap: float | None = None,
                            sinks: jax.Array | None = None) -> jax.Array:
    """`invariant_attention`'s contract on the C++ decode kernel (the "cpu" backend, pools
    `cpu_ffi.supports`): every token is a kernel row of one query whose length is its
    position + 1, so its result depends on its own query and keys only. The sinks scale the
    (acc, max, denominator) state the kernel returns, outside the C++ code.

    Returns:
        [num_tokens, num_q_heads, head_dim] in q's dtype; padded tokens are zero.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    check_sinks(sinks, num_q_heads)
    kv_heads = kv_pages.shape[2]
    seq_ids, q_pos, valid = token_positions(md, num_tokens)
    lens = jnp.where(valid, q_pos + 1, 0)  # i32[T]: every token a row of one query
    qg = q.astype(jnp.float32).reshape(num_tokens, kv_heads, num_q_heads // kv_heads, head_dim)
    acc, m, denom = cpu_ffi.paged_decode_cpu(
        qg, kv_pages, layer, md.block_tables[seq_ids], lens,
        jnp.asarray(sliding_window, jnp.int32), sm_scale=sm_scale, soft_cap=soft_cap)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # f32[T, k, g, d]
    if sinks is not None:
        out = out * sink_factor(m, denom, grouped_sinks(sinks, kv_heads))[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

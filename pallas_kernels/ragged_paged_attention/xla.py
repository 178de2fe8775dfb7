"""Ragged paged attention in plain XLA whose cost follows the live context, not max_model_len.

The reference (`reference.py`) gathers every query token's whole block table. This path
splits the tokens into two disjoint kinds, each with its own loops, merged at the end:

* decode part: a request whose single new token sits at token index == its row index (the
  runner packs decode rows first) reads its context from the pool in blocks of
  `decode_block_kv` keys: the live (row, block) pairs are a work list walked `rows` pairs
  at a time (a `fori_loop` with a traced trip count: no compile per context length), so
  each row reads only its own blocks, in groups of `decode_rows` rows so a gathered block
  stays in the cache; K and V are gathered apart, head-major, and the logits computed
  keys x queries, so the matmuls read K and V where the gathers wrote them (no
  transposed copy);
* context part: every other token reads its request's keys [0, kv_len) from the pool,
  causally masked by position (this step's own K/V are written before attention runs,
  so earlier chunks, prefix-cache hits and the step's own tokens are one range), in
  tiles of one request's query tokens: a tile gathers its request's pages once per key
  block, for the blocks up to its last query's position only, and works head-major
  inside the tile (logits [heads, tile queries x group, keys]); with `md.short_tiles`
  (engines that verify speculative proposals) requests of a few tokens get a pass of
  their own in small tiles.

With `cpu_decode` (the CPU backend), the C++ kernel that reads pages in place takes the
decode rows and also every token of the requests whose context is short (each token one
kernel row, its length its position + 1): below ~800 keys that beat the tiles' gathers,
masks and small matmuls; longer contexts keep the tiles.

Every key read is masked by the request's length, so free or null pages (even NaN) never
change a result, as in the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_ffi import paged_decode_cpu, supports
from pallas_kernels.kv_quant import dequantize_kv
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ragged_paged_attention.reference import (
    causal_limit,
    check_shapes,
    chunk_ok,
    token_positions,
)
from pallas_kernels.sinks import check_sinks, grouped_sinks, sink_factor
from pallas_kernels.tuning import tuned

_NEG = -1e30  # running max of a row that has seen no key yet (finite: exp(_NEG - m) == 0)


def _init(lead, head_dim):
    """An empty online-softmax state (acc [*lead, head_dim], m [*lead], denom [*lead])."""
    return (jnp.zeros((*lead, head_dim), jnp.float32), jnp.full(lead, _NEG, jnp.float32),
            jnp.zeros(lead, jnp.float32))


def _merge(a, b):
    """Two online-softmax states of the same queries, combined."""
    m = jnp.maximum(a[1], b[1])
    sa, sb = jnp.exp(a[1] - m), jnp.exp(b[1] - m)
    return (a[0] * sa[..., None] + b[0] * sb[..., None], m, a[2] * sa + b[2] * sb)


def _window_ok(q_pos, k_pos, span):
    """bool[n, c]: key positions inside the sliding window (0: none) and the attention
    chunk (0: none) of each query; `span` is (window, chunk)."""
    window, chunk = span
    return ((window <= 0) | (q_pos[:, None] - k_pos < window)) & chunk_ok(q_pos[:, None], k_pos,
                                                                          chunk)


def _tiles_by_head(kv_pages, layer, page_ids, kv):
    """The K (`kv` 0) or V (1) tiles (f32) of `page_ids` [n, p] in layer `layer`, head axis
    first: [kv_heads, n, p, page_size, head_dim], the layout in which batched matmuls over
    (head, row) read them as they are.

    NOTE: the head axis is a gather *batching* dimension: XLA lays a gather's output out
    with its index dimensions first, so with heads as a slice dimension the tiles came out
    row-major and each needed a transposed copy per layer and block; as a batching
    dimension it stays a dimension of the operand, so tensor parallelism (the pool split
    on its head axis) still keeps each device on its own heads.
    """
    _, _, heads, _, page_size, row = kv_pages.shape
    n, p = page_ids.shape
    shape = (heads, n, p)
    idx = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), shape),
                     jnp.full(shape, kv, jnp.int32),
                     jnp.broadcast_to(page_ids.astype(jnp.int32), shape)],
                    axis=-1)  # i32[kv_heads, n, p, 3]
    # NOTE: without the barrier XLA fuses the index arithmetic into the gather's loop and
    # recomputes it for every gathered element (BENCHMARKS.md, "K and V gathered apart").
    idx = jax.lax.optimization_barrier(idx)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(3, 4), collapsed_slice_dims=(0, 1, 3),
                                          start_index_map=(0, 1, 3),
                                          operand_batching_dims=(2,),
                                          start_indices_batching_dims=(0,))
    tiles = jax.lax.gather(kv_pages, idx, dims, (1, 1, 1, 1, page_size, row),
                           mode=jax.lax.GatherScatterMode.CLIP)
    return dequantize_kv(tiles)


def _block_update(state, logits, v, mask, v_keep, pv, sm_scale, soft_cap):
    """One online-softmax step over a block of gathered pages.

    Args:
        state: (acc, m, denom): acc [..., d] per query row, m and denom without the d axis.
        logits: q.k of the block, the block's keys on the last two axes, so the softmax's
            elementwise work runs along contiguous keys (keys on a 3-wide minor axis made
            its exp 6x slower on this CPU).
        v: The block's values, laid out as `pv` (p, v -> acc) says.
        mask: bool, broadcastable to the logits: keys each query may see.
        v_keep: bool, broadcastable to v: slots read at all (NaN elsewhere must not leak).
    """
    logits = logits * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(mask, logits, -jnp.inf)
    acc, m, denom = state
    m_new = jnp.maximum(m, jnp.max(logits, axis=(-2, -1)))
    p = jnp.exp(logits - m_new[..., None, None])
    scale = jnp.exp(m - m_new)
    v = jnp.where(v_keep, v, 0.0)
    acc = acc * scale[..., None] + jnp.einsum(pv, p, v)
    return acc, m_new, denom * scale + jnp.sum(p, axis=(-2, -1))


def _paged_part(q, kv_pages, layer, pages, lens, q_pos, span, *, block_kv, sm_scale,
                soft_cap):
    """Attention of q [n, k, g, d] over positions [0, lens) of the pages `pages` [n, w].

    Work is a list of live (row, key block) pairs, `n` per iteration, so a row reads only
    its own blocks: with a loop over blocks for all rows, a batch of short chats beside one
    long document gathered (masked) blocks up to the document's length for every row, and
    padded rows gathered every block. Each pair's partial softmax state merges into its
    row's by scatter (max, then scaled adds), so one row's pairs may share an iteration.
    """
    n, kv_heads, group, head_dim = q.shape
    page_size = kv_pages.shape[4]
    ppb = block_kv // page_size
    width = pages.shape[1]
    pad = (-width) % ppb
    if pad:
        pages = jnp.pad(pages, ((0, 0), (0, pad)))  # i32[n, width + pad]; page 0 is masked
    nb = (lens + block_kv - 1) // block_kv  # i32[n] key blocks of each row
    ends = jnp.cumsum(nb)  # i32[n]
    total = ends[-1]
    q = jnp.swapaxes(q, 0, 1)  # [k, n, g, d]

    def body(i, state):
        pair = i * n + jnp.arange(n, dtype=jnp.int32)  # i32[n] this iteration's pairs
        r = jnp.minimum(jnp.searchsorted(ends, pair, side="right"), n - 1).astype(jnp.int32)
        b = pair - (ends[r] - nb[r])  # i32[n] block of its row
        cols = b[:, None] * ppb + jnp.arange(ppb, dtype=jnp.int32)  # i32[n, ppb]
        ids = jnp.take_along_axis(pages[r], jnp.clip(cols, 0, pages.shape[1] - 1),
                                  axis=1)  # i32[n, ppb]
        k = _tiles_by_head(kv_pages, layer, ids, 0)  # [k, n, ppb, page_size, head_dim]
        v = _tiles_by_head(kv_pages, layer, ids, 1)  # [k, n, ppb, page_size, head_dim]
        k_pos = b[:, None] * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # i32[n, C]
        mask = ((pair < total)[:, None] & (k_pos < lens[r][:, None])
                & _window_ok(q_pos[r], k_pos, span))  # bool[n, C]
        mask = mask.reshape(1, n, 1, ppb, page_size)  # bool[1, n, 1, ppb, page_size]
        # NOTE: logits computed keys x queries (the gathered K is the matmul's left operand
        # as it lies; q . K^T made XLA copy K transposed per layer and block), then turned
        # keys-last for the softmax ([k, n, g, ppb, page_size]).
        logits = jnp.moveaxis(jnp.einsum("knpcd,kngd->knpcg", k, q[:, r]), -1, 2)
        # Each pair's own softmax state ([k, n, g, ...]; m finite), from an empty one.
        acc_p, m_p, l_p = _block_update(empty, logits, v, mask, jnp.moveaxis(mask, 2, -1),
                                        "kngpc,knpcd->kngd", sm_scale, soft_cap)
        acc, m, denom = state
        m_new = jnp.maximum(m, jnp.full_like(m, _NEG).at[:, r].max(m_p))
        scale = jnp.exp(m - m_new)
        scale_p = jnp.exp(m_p - m_new[:, r])  # [k, n, g]
        acc = (acc * scale[..., None]
               + jnp.zeros_like(acc).at[:, r].add(acc_p * scale_p[..., None]))
        denom = denom * scale + jnp.zeros_like(denom).at[:, r].add(l_p * scale_p)
        return acc, m_new, denom

    empty = _init((kv_heads, n, group), head_dim)
    iters = (total + n - 1) // n
    state = jax.lax.fori_loop(0, iters, body, empty)
    return tuple(jnp.swapaxes(x, 0, 1) for x in state)


def _context_part(q, kv_pages, layer, md, row_lens, q_pos, span, *, block_kv, block_q,
                  sm_scale, soft_cap, state=None, q_hi=None):
    """Causal attention of every token to its request's first `row_lens` keys (i32[rows];
    the whole context kv_len, this step's tokens included; 0 for requests this pass
    skips), in query tiles of `block_q` tokens of one request: each tile gathers its
    request's pages once per key block, up to the block of its last query's position,
    and attends with matmuls batched over KV heads, instead of one gather per token.

    Tiles are enumerated on the device (rows this pass covers, ceil(q_len / block_q) tiles
    each) and walked by a `fori_loop` with a traced trip count. `state` ([t, ...]
    online-softmax state) carries the results of an earlier pass over other rows. `q_hi`
    (i32[t], default `q_pos`): the last key each query sees (`causal_limit`).
    """
    t, kv_heads, group, head_dim = q.shape
    page_size = kv_pages.shape[4]
    ppb = block_kv // page_size
    starts = md.cu_q_lens[:-1]  # i32[rows]
    q_lens = md.cu_q_lens[1:] - starts  # i32[rows]
    tiles = jnp.where(row_lens > 0, (q_lens + block_q - 1) // block_q, 0)  # i32[rows]
    ends = jnp.cumsum(tiles)  # i32[rows]
    pages = md.block_tables
    pad = (-pages.shape[1]) % ppb
    if pad:
        pages = jnp.pad(pages, ((0, 0), (0, pad)))  # page 0 is masked by `lens`
    # NOTE: padded by a tile, so a tile's slice is never clamped (shifted) at the end.
    qp = jnp.pad(q, ((0, block_q), (0, 0), (0, 0), (0, 0)))
    posp = jnp.pad(q_pos, (0, block_q))
    hip = posp if q_hi is None else jnp.pad(q_hi, (0, block_q))

    def tile(i, state):
        r = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
        first = starts[r] + (i - (ends[r] - tiles[r])) * block_q
        qt = jax.lax.dynamic_slice_in_dim(qp, first, block_q)  # [block_q, k, g, d]
        pos = jax.lax.dynamic_slice_in_dim(posp, first, block_q)  # i32[block_q]
        mine = first + jnp.arange(block_q) < starts[r] + q_lens[r]  # bool[block_q]
        hi = jax.lax.dynamic_slice_in_dim(hip, first, block_q)  # i32[block_q]
        length = row_lens[r]
        if q_hi is None:
            last = jnp.minimum(first + block_q, starts[r] + q_lens[r]) - 1
            seen = jnp.minimum(length, posp[last] + 1)  # keys the tile's last query sees
        else:  # a span's early query may see past the tile's last one
            seen = jnp.minimum(length, jnp.max(jnp.where(mine, hi, -1)) + 1)

        # NOTE: head-major inside a tile ([k, block_q * g, ...], one transpose per tile):
        # the matmuls batch over heads with no transposed copy of K, V or P per block
        # (BENCHMARKS.md, "the context part head-major inside a query tile").
        qh = jnp.swapaxes(qt, 0, 1).reshape(kv_heads, block_q * group, head_dim)

        def block(b, st):
            ids = jax.lax.dynamic_slice_in_dim(pages[r], b * ppb, ppb)[None]  # i32[1, ppb]
            # NOTE: the block's keys as one axis (pages x slots as two made XLA copy P and
            # K per block); [k, 1, block_kv, d] fits `_block_update`'s two key axes.
            k = _tiles_by_head(kv_pages, layer, ids, 0).reshape(kv_heads, 1, block_kv, head_dim)
            v = _tiles_by_head(kv_pages, layer, ids, 1).reshape(kv_heads, 1, block_kv, head_dim)
            k_pos = b * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # i32[block_kv]
            mask = ((k_pos[None, :] < length) & (k_pos[None, :] <= hi[:, None])
                    & _window_ok(pos, k_pos[None, :], span))  # bool[block_q, block_kv]
            mask = jnp.repeat(mask, group, axis=0).reshape(1, block_q * group, 1, block_kv)
            # Values zeroed outside what any query of the tile sees: past the context, and
            # before the window of its first (earliest) query, where a sliding KV cache
            # group's given-back pages read as the null page.
            keep = ((k_pos < length) & _window_ok(pos[:1], k_pos[None, :], span)[0]
                    ).reshape(1, 1, block_kv, 1)
            return _block_update(st, jnp.einsum("kqd,kpcd->kqpc", qh, k), v, mask, keep,
                                 "kqpc,kpcd->kqd", sm_scale, soft_cap)

        num_blocks = (seen + block_kv - 1) // block_kv
        new = jax.lax.fori_loop(0, num_blocks, block, _init((kv_heads, block_q * group),
                                                            head_dim))  # [k, block_q * g, ...]
        new = tuple(jnp.swapaxes(x.reshape((kv_heads, block_q, group) + x.shape[2:]), 0, 1)
                    for x in new)  # back to [block_q, k, g, ...]
        out = []
        for whole, part in zip(state, new, strict=True):
            old = jax.lax.dynamic_slice_in_dim(whole, first, block_q)
            keep_new = mine.reshape((block_q,) + (1,) * (part.ndim - 1))
            out.append(jax.lax.dynamic_update_slice_in_dim(
                whole, jnp.where(keep_new, part, old), first, axis=0))
        return tuple(out)

    state = _init((t, kv_heads, group), head_dim) if state is None else state
    state = tuple(jnp.pad(x, ((0, block_q),) + ((0, 0),) * (x.ndim - 1), constant_values=c)
                  for x, c in zip(state, (0.0, _NEG, 0.0), strict=True))
    state = jax.lax.fori_loop(0, ends[-1], tile, state)
    return tuple(x[:t] for x in state)


def ragged_paged_attention_xla(
    q: jax.Array,
    kv_pages: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: jax.Array | int = 0,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    block_kv: int | None = None,
    block_q: int | None = None,
    block_q_short: int | None = None,
    decode_block_kv: int | None = None,
    decode_rows: int | None = None,
    cpu_decode: bool = False,
    cpu_decode_min_rows: int | None = None,
    cpu_context_max_len: int | None = None,
    chunk_size: jax.Array | int = 0,
) -> jax.Array:
    """Causal attention of packed queries over each request's paged K/V (see the module).

    Args:
        q: [num_tokens, num_q_heads, head_dim] queries (rotary applied); this step's K/V
            are already written to the pool.
        kv_pages: dtype[num_layers, 2, num_kv_heads, num_pages, page_size, head_dim].
        layer: Layer index into the pool (may be traced).
        md: Attention metadata of this step (any packing; decode rows first is fastest).
        sm_scale: Scale applied to q.k.
        sliding_window: Keys older than `window` positions are masked; 0 means none.
        soft_cap: If set, logits become `soft_cap * tanh(logits / soft_cap)`.
        sinks: f32[num_q_heads] sink logits (`pallas_kernels.sinks`), applied to the merged
            state of the decode and context parts (the C++ kernel's rows included); None:
            no sinks.
        The sizes and thresholds below default to the platform's row of
        `pallas_kernels.tuning` ("ragged_xla"); BENCHMARKS.md has the measurements.
        block_kv: Keys per gathered block (rounded to whole pages).
        block_q: Query tokens (of one request) per tile of the context part.
        block_q_short: Tile of the context part for requests with at most this many new
            tokens (proposals being verified, a chunk's short tail) when `md.short_tiles`:
            their own pass, so a 4-token request does not fill a 64-query tile with
            padding.
        decode_block_kv: Keys per gathered block of the decode part.
        decode_rows: Decode rows per group: each group of rows walks its own (row, key
            block) pairs, as many per iteration as it has rows, so a gathered block
            (`decode_rows x decode_block_kv` keys) stays small enough for the cache
            whatever the batch.
        cpu_decode: Decode rows go to the C++ kernel that reads the pool in place
            (`pallas_kernels.cpu_ffi`, CPU only) instead of the gathered blocks above;
            pools it does not read (8-bit, bf16) keep the XLA decode part.
        cpu_decode_min_rows: Steps of fewer tokens than this keep the XLA decode part
            (where the kernel's step is not faster).
        cpu_context_max_len: With the kernel, requests with at most this many keys
            (their kv_len) send every token to it too, each token a row of one query
            (it re-reads its request's pages, from the cache); longer ones use the
            context part's tiles, whose batched matmuls win on long contexts. 0: decode
            rows only.
        chunk_size: Chunked local attention (Llama 4; may be traced): a query at position p
            sees keys from floor(p / chunk_size) * chunk_size on; 0 means none. The C++
            rows read a block table shifted to the chunk's first page when the chunk is a
            whole number of pages; otherwise the tokens go to the XLA parts.

    Bidirectional spans (`md.q_span_end`): the rows holding one go to the context part,
    whose tiles read keys up to each query's `causal_limit`.

    Returns:
        [num_tokens, num_q_heads, head_dim] outputs in q's dtype; padded tokens are zero.
    """
    check_shapes(q, kv_pages, md, widens=True)
    check_sinks(sinks, q.shape[1])
    t = tuned("ragged_xla")
    block_kv = t["block_kv"] if block_kv is None else block_kv
    block_q = t["block_q"] if block_q is None else block_q
    block_q_short = t["block_q_short"] if block_q_short is None else block_q_short
    decode_block_kv = t["decode_block_kv"] if decode_block_kv is None else decode_block_kv
    decode_rows = t["decode_rows"] if decode_rows is None else decode_rows
    cpu_decode_min_rows = (t["cpu_decode_min_rows"] if cpu_decode_min_rows is None
                           else cpu_decode_min_rows)
    cpu_context_max_len = (t["cpu_context_max_len"] if cpu_context_max_len is None
                           else cpu_context_max_len)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[2], kv_pages.shape[4]
    group = num_q_heads // num_kv_heads
    block_kv = max(page_size, block_kv // page_size * page_size)
    window = jnp.asarray(sliding_window, jnp.int32)
    chunk = jnp.asarray(chunk_size, jnp.int32)
    span = (window, chunk)
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    seq_ids, q_pos, valid = token_positions(md, num_tokens)
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]  # i32[num_rows]
    common = dict(sm_scale=sm_scale, soft_cap=soft_cap)
    # Rows with a bidirectional span (`md.q_span_end`) keep to the context part's tiles:
    # the decode part and the C++ rows see keys up to the query's own position only.
    q_hi = None if md.q_span_end is None else causal_limit(md, q_pos)
    spanned = (None if q_hi is None else jnp.zeros(md.kv_lens.shape[0], bool).at[seq_ids].max(
        valid & (q_hi > q_pos)))  # bool[rows]

    if cpu_decode and supports(kv_pages) and num_tokens >= cpu_decode_min_rows:
        # Single-token rows (decodes, wherever they sit) and short contexts' tokens: each
        # token a kernel row whose one query sits at its position (lens = position + 1;
        # 0 leaves the token to the tiles).
        taken = (q_lens == 1) | (md.kv_lens <= cpu_context_max_len)  # bool[rows]
        if spanned is not None:
            taken &= ~spanned
        # A chunk of whole pages: each token's table starts at its chunk's first page, so
        # the kernel (which masks by length and window only) reads the chunk alone.
        tables = md.block_tables[seq_ids]  # i32[num_tokens, width]
        first = jnp.zeros_like(q_pos)  # i32[num_tokens]: each token's first key
        if not (isinstance(chunk_size, int) and chunk_size == 0):  # static: others unchanged
            taken &= (chunk <= 0) | (chunk % page_size == 0)
            first = jnp.where(chunk > 0, q_pos - q_pos % jnp.maximum(chunk, 1), 0)
            cols = (jnp.arange(tables.shape[1], dtype=jnp.int32)[None, :]
                    + (first // page_size)[:, None])  # i32[num_tokens, width]
            tables = jnp.take_along_axis(tables, jnp.minimum(cols, tables.shape[1] - 1), axis=1)
        lens = jnp.where(valid & taken[seq_ids], q_pos + 1 - first, 0)  # i32[num_tokens]
        decode = paged_decode_cpu(qg, kv_pages, layer, tables, lens, window, **common)
    else:
        # Decode part: row i's single token is token i.
        rows = min(md.kv_lens.shape[0], num_tokens)
        row_ids = jnp.arange(rows, dtype=jnp.int32)
        aligned = (md.cu_q_lens[:rows] == row_ids) & (q_lens[:rows] == 1)  # bool[rows]
        if spanned is not None:
            aligned &= ~spanned[:rows]
        dec_lens = jnp.where(aligned, md.kv_lens[:rows], 0)  # i32[rows]
        decode_block_kv = max(page_size, decode_block_kv // page_size * page_size)
        groups = [slice(i, min(i + decode_rows, rows)) for i in range(0, rows, decode_rows)]
        parts = [_paged_part(qg[g], kv_pages, layer, md.block_tables[g], dec_lens[g],
                             dec_lens[g] - 1, span, block_kv=decode_block_kv, **common)
                 for g in groups]
        pad = num_tokens - rows
        decode = tuple(jnp.pad(jnp.concatenate(xs), ((0, pad),) + ((0, 0),) * (xs[0].ndim - 1),
                               constant_values=c)
                       for xs, c in zip(zip(*parts, strict=True), (0.0, _NEG, 0.0), strict=True))
        taken = jnp.zeros(md.kv_lens.shape[0], bool).at[:rows].set(aligned)  # bool[rows]

    # Context part: every other row's whole context, this step's tokens included.
    ctx_lens = jnp.where(taken | (q_lens == 0), 0, md.kv_lens)  # i32[rows]; padding: 0

    def context(ctx_lens):
        state = None
        if md.short_tiles:  # a second loop (more compile time per program)
            short = q_lens <= block_q_short  # bool[rows]
            state = _context_part(qg, kv_pages, layer, md, jnp.where(short, ctx_lens, 0),
                                  q_pos, span, block_kv=block_kv, block_q=block_q_short,
                                  q_hi=q_hi, **common)
            ctx_lens = jnp.where(short, 0, ctx_lens)
        return _context_part(qg, kv_pages, layer, md, ctx_lens, q_pos, span,
                             block_kv=block_kv, block_q=block_q, state=state, q_hi=q_hi,
                             **common)

    # NOTE: skipped at run time when no row needs it (decode steps): its padded query
    # copies and empty loops cost ~20 us a layer on a batch-1 step (BENCHMARKS.md,
    # "the batch-1 step's attention").
    state = jax.lax.cond(jnp.any(ctx_lens > 0), context,
                         lambda _: _init((num_tokens, num_kv_heads, group), head_dim), ctx_lens)
    acc, m, denom = _merge(state, decode)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    if sinks is not None:  # [t, k, g] factor of each row
        out = out * sink_factor(m, denom, grouped_sinks(sinks, num_kv_heads))[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

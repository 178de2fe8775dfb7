"""MLA over latent pages in plain XLA, its cost following the live context (the "xla" and
"cpu" backends' path; `reference.py` is its oracle).

Tokens go to query tiles of one request each, in two passes with their own tile size: the
decode pass takes every request of one new token (a tile of one token, wherever it sits
in the packing), the context pass cuts every other request's tokens into tiles of
`block_q`. A pass walks a work list of live (tile, key block) pairs, `pairs` per
iteration of a `fori_loop` with a traced trip count, so a tile reads its own request's
blocks only up to its last query's position (no compile per context length, no work for
padding). A pair gathers its block's latent rows once and uses them twice: the whole row
as keys (q_latent . c_kv + q_pe . k_pe is one dot with [q_latent, q_pe]), its first R
values as values. All H heads of a token share the one latent head, so a tile's logits
are [tile tokens x H, block keys]: the absorbed form's matmuls are wide even for decode.
Each pair's partial softmax merges into its tile's state by scatter (max, then scaled
adds). The context pass is skipped at run time on steps without such requests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import dequantize_kv
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.mla.reference import check_expanded_shapes, check_mla_shapes
from pallas_kernels.tuning import tuned

_NEG = -1e30  # running max of a row that has seen no key yet (finite: exp(_NEG - m) == 0)


def _latent_blocks(pool, slot, ids):
    """f32[n, p * page_size, W]: the latent rows of pages `ids` i32[n, p] of slot `slot`."""
    # NOTE: the indices pass a barrier, as in the GQA path: XLA otherwise fuses their
    # arithmetic into the gather and recomputes it for every gathered element.
    ids = jax.lax.optimization_barrier(ids)
    rows = pool[slot, 0, 0, ids]  # dtype[n, p, page_size, W(+4 if 8-bit)]
    return dequantize_kv(rows.reshape(ids.shape[0], -1, rows.shape[-1]))


def _absorbed(rank):
    """The absorbed form's (scores, mix, output width) for `_pass`: keys are whole latent
    rows (q = [q_latent, q_pe]), values their first `rank` values."""
    def scores(qt, lat):  # f32[n, tq, H, W], f32[n, C, W] -> f32[n, tq, H, C]
        return jnp.einsum("nqhw,ncw->nqhc", qt, lat)

    def mix(p, lat, keep):  # f32[n, tq, H, C] -> f32[n, tq, H, R]
        # NaN in a masked slot (free pages) must not leak through 0 * NaN.
        c_kv = jnp.where(keep[..., None], lat[..., :rank], 0.0)  # f32[n, C, R]
        return jnp.einsum("nqhc,ncr->nqhr", p, c_kv)

    return scores, mix, rank


def _expanded(w_uk, w_uv):
    """The expanded form's (scores, mix, output width) for `_pass`: each gathered block's
    latents become per-head keys [c_kv W_UK, k_pe] and values c_kv W_UV (q = [q_nope, q_pe]),
    then ordinary multi-head attention."""
    rank, _, dn = w_uk.shape

    def scores(qt, lat):  # f32[n, tq, H, Dn + Dr], f32[n, C, R + Dr] -> f32[n, tq, H, C]
        k_nope = jnp.einsum("ncr,rhd->nchd", lat[..., :rank], w_uk)  # f32[n, C, H, Dn]
        return (jnp.einsum("nqhd,nchd->nqhc", qt[..., :dn], k_nope)
                + jnp.einsum("nqhe,nce->nqhc", qt[..., dn:], lat[..., rank:]))

    def mix(p, lat, keep):  # f32[n, tq, H, C] -> f32[n, tq, H, Dv]
        c_kv = jnp.where(keep[..., None], lat[..., :rank], 0.0)  # f32[n, C, R]
        v = jnp.einsum("ncr,rhv->nchv", c_kv, w_uv)  # f32[n, C, H, Dv]
        return jnp.einsum("nqhc,nchv->nqhv", p, v)

    return scores, mix, w_uv.shape[2]


def _pass(q, pool, slot, md, tiles, form, *, tq, pairs, block_kv, sm_scale):
    """Outputs f32[T, H, out] of the tokens in `tiles` (zeros for the others).

    Args:
        q: f32[T, H, W] the queries ([q_latent, q_pe] absorbed, [q_nope, q_pe] expanded).
        tiles: (seq, first, length) i32[n_tiles] each: a tile's request, its first token on
            the packed axis and its valid tokens (<= tq; 0 for unused tiles).
        form: (scores, mix, out) of `_absorbed` or `_expanded`.
    """
    scores, mix, out_width = form
    num_tokens, num_heads, _ = q.shape
    page_size = pool.shape[4]
    ppb = block_kv // page_size
    seq, first, length = tiles
    n_tiles = seq.shape[0]
    q_start, q_lens = md.cu_q_lens[seq], md.cu_q_lens[seq + 1] - md.cu_q_lens[seq]
    pos0 = md.kv_lens[seq] - q_lens + (first - q_start)  # i32[n_tiles] first query's position
    keys = jnp.where(length > 0, pos0 + length, 0)  # i32[n_tiles] keys the last query sees
    nb = (keys + block_kv - 1) // block_kv  # i32[n_tiles] key blocks of each tile
    ends = jnp.cumsum(nb)
    total = ends[-1]
    tables = jnp.pad(md.block_tables, ((0, 0), (0, -md.block_tables.shape[1] % ppb)))
    qp = jnp.pad(q, ((0, tq), (0, 0), (0, 0)))  # a tile read past the last token stays inside
    lane = jnp.arange(tq, dtype=jnp.int32)

    def body(i, state):
        pair = i * pairs + jnp.arange(pairs, dtype=jnp.int32)  # i32[n]
        t = jnp.minimum(jnp.searchsorted(ends, pair, side="right"), n_tiles - 1)
        b = pair - (ends[t] - nb[t])  # i32[n] key block of the pair within its tile
        cols = jnp.clip(b[:, None] * ppb + jnp.arange(ppb), 0, tables.shape[1] - 1)
        ids = jnp.take_along_axis(tables[seq[t]], cols, axis=1)  # i32[n, ppb]
        lat = _latent_blocks(pool, slot, ids)  # f32[n, C, W]
        qt = qp[first[t][:, None] + lane]  # f32[n, tq, H, W]
        k_pos = b[:, None] * block_kv + jnp.arange(block_kv)  # i32[n, C]
        q_pos = pos0[t][:, None] + lane  # i32[n, tq]
        keep = (pair < total)[:, None] & (k_pos < keys[t][:, None])  # bool[n, C]
        mask = (keep[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
                & (lane < length[t][:, None])[:, :, None])[:, :, None, :]  # bool[n, tq, 1, C]
        logits = scores(qt, lat) * sm_scale  # f32[n, tq, H, C]
        logits = jnp.where(mask, logits, _NEG)
        m_p = jnp.max(logits, axis=-1)  # f32[n, tq, H]
        p = jnp.where(mask, jnp.exp(logits - m_p[..., None]), 0.0)
        acc_p = mix(p, lat, keep)  # f32[n, tq, H, out]
        acc, m, denom = state
        m_new = jnp.maximum(m, jnp.full_like(m, _NEG).at[t].max(m_p))
        scale, scale_p = jnp.exp(m - m_new), jnp.exp(m_p - m_new[t])
        acc = acc * scale[..., None] + jnp.zeros_like(acc).at[t].add(acc_p * scale_p[..., None])
        denom = denom * scale + jnp.zeros_like(denom).at[t].add(p.sum(-1) * scale_p)
        return acc, m_new, denom

    lead = (n_tiles, tq, num_heads)
    init = (jnp.zeros((*lead, out_width), jnp.float32), jnp.full(lead, _NEG, jnp.float32),
            jnp.zeros(lead, jnp.float32))
    acc, _, denom = jax.lax.fori_loop(0, (total + pairs - 1) // pairs, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # f32[n_tiles, tq, H, out]
    tok = jnp.where(lane < length[:, None], first[:, None] + lane, num_tokens)  # dropped
    return jnp.zeros((num_tokens, num_heads, out_width), jnp.float32).at[tok].set(
        out, mode="drop")


def _context_tiles(md: AttentionMetadata, num_tokens: int, block_q: int):
    """(seq, first, length) of the context pass: requests of more than one new token cut
    into tiles of `block_q` tokens (a static bound of num_tokens // block_q + num_seqs)."""
    num_seqs = md.kv_lens.shape[0]
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]  # i32[num_seqs]
    n = jnp.where(q_lens > 1, (q_lens + block_q - 1) // block_q, 0)  # i32[num_seqs]
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(n)])
    i = jnp.arange(num_tokens // block_q + num_seqs, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], i, side="right"), num_seqs - 1).astype(jnp.int32)
    offset = (i - cu[seq]) * block_q  # first query of the tile within its request
    length = jnp.where(i < cu[-1], jnp.clip(q_lens[seq] - offset, 0, block_q), 0)
    return seq, md.cu_q_lens[seq] + offset, length


def _passes(pool, slot, md, num_tokens, decode, context, *, sm_scale, block_kv, block_q,
            decode_block_kv, decode_rows):
    """(decode pass outputs, context pass outputs) f32[T, H, out] each: `decode` and `context`
    are the (q, form) of each pass; the sizes default to `tuned("mla_xla")`."""
    t = tuned("mla_xla")
    page_size = pool.shape[4]
    whole = lambda n: max(page_size, n // page_size * page_size)  # noqa: E731
    block_kv = whole(t["block_kv"] if block_kv is None else block_kv)
    decode_block_kv = whole(t["decode_block_kv"] if decode_block_kv is None else decode_block_kv)
    block_q = t["block_q"] if block_q is None else block_q
    decode_rows = t["decode_rows"] if decode_rows is None else decode_rows
    num_seqs = md.kv_lens.shape[0]
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]  # i32[num_seqs]
    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    decode_tiles = (seqs, md.cu_q_lens[:-1], jnp.where(q_lens == 1, 1, 0))
    dec = _pass(decode[0], pool, slot, md, decode_tiles, decode[1], tq=1,
                pairs=min(decode_rows, num_seqs), block_kv=decode_block_kv, sm_scale=sm_scale)
    ctx_tiles = _context_tiles(md, num_tokens, block_q)
    q_ctx, ctx_form = context
    # NOTE: skipped at run time on decode steps (its tiles' loops and copies cost a
    # layer's worth of small ops for nothing there).
    ctx = jax.lax.cond(
        jnp.any(q_lens > 1),
        lambda: _pass(q_ctx, pool, slot, md, ctx_tiles, ctx_form, tq=block_q, pairs=1,
                      block_kv=block_kv, sm_scale=sm_scale),
        lambda: jnp.zeros((*q_ctx.shape[:2], ctx_form[2]), jnp.float32))
    return dec, ctx


def mla_attention_xla(q_latent: jax.Array, q_pe: jax.Array, pool: jax.Array, slot,
                      md: AttentionMetadata, *, sm_scale: float, block_kv: int | None = None,
                      block_q: int | None = None, decode_block_kv: int | None = None,
                      decode_rows: int | None = None) -> jax.Array:
    """Absorbed-form MLA over latent pages; the contract is `mla_attention_reference`'s.

    Args:
        block_kv: Keys per gathered block of the context pass (rounded to whole pages).
        block_q: Query tokens (of one request) per tile of the context pass.
        decode_block_kv: Keys per gathered block of the decode pass.
        decode_rows: Decode rows per iteration of the decode pass.
        The sizes default to `pallas_kernels.tuning`'s "mla_xla" row.

    Returns:
        [num_tokens, num_heads, R] in q_latent's dtype; padded tokens are zero.
    """
    check_mla_shapes(q_latent, q_pe, pool, md, widens=True)
    rank = q_latent.shape[2]
    q = jnp.concatenate([q_latent, q_pe], axis=-1).astype(jnp.float32)  # f32[T, H, R + Dr]
    form = (q, _absorbed(rank))
    dec, ctx = _passes(pool, slot, md, q.shape[0], form, form, sm_scale=sm_scale,
                       block_kv=block_kv, block_q=block_q, decode_block_kv=decode_block_kv,
                       decode_rows=decode_rows)
    return (dec + ctx).astype(q_latent.dtype)


def mla_attention_expanded_xla(q_nope: jax.Array, q_pe: jax.Array, pool: jax.Array, slot,
                               md: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array, *,
                               sm_scale: float, absorbed_decode: bool = False,
                               block_kv: int | None = None, block_q: int | None = None,
                               decode_block_kv: int | None = None,
                               decode_rows: int | None = None) -> jax.Array:
    """Expanded-form MLA over latent pages; the contract is `mla_expanded_reference`'s.

    Each gathered key block's latents are expanded into per-head keys [c_kv W_UK, k_pe] and
    values c_kv W_UV inside the pass (never a per-head pool): R x H x (Dn + Dv) work per key
    and query tile, shared by the tile's `block_q` queries, then (Dn + Dr) + Dv per key, head
    and query, against the absorbed form's (R + Dr) + R per key, head and query.
    `absorbed_decode` runs the decode pass (requests of one new token: a tile is one query,
    nothing shares the expansion) in the absorbed form instead (q_nope W_UK^T, attention over
    the latents, W_UV after: vLLM's split of prefill and decode).

    Args:
        q_nope: [T, H, Dn] the query parts without rotary.
        q_pe: [T, H, Dr] roped query parts.
        pool, slot, md: As `mla_attention_xla`.
        w_uk: [R, H, Dn] the key up-projection; w_uv: [R, H, Dv] the value up-projection.
        sm_scale: Scale of the scores.
        absorbed_decode: The decode pass in the absorbed form.
        block_kv, block_q, decode_block_kv, decode_rows: As `mla_attention_xla`.

    Returns:
        [T, H, Dv] in q_nope's dtype; padded tokens are zero.
    """
    check_expanded_shapes(q_nope, q_pe, pool, md, w_uk, w_uv)
    w_uk, w_uv = w_uk.astype(jnp.float32), w_uv.astype(jnp.float32)
    q = jnp.concatenate([q_nope, q_pe], axis=-1).astype(jnp.float32)  # f32[T, H, Dn + Dr]
    expanded = (q, _expanded(w_uk, w_uv))
    decode = expanded
    if absorbed_decode:
        q_latent = jnp.einsum("thn,rhn->thr", q[..., :q_nope.shape[2]], w_uk)  # f32[T, H, R]
        decode = (jnp.concatenate([q_latent, q[..., q_nope.shape[2]:]], axis=-1),
                  _absorbed(w_uk.shape[0]))
    dec, ctx = _passes(pool, slot, md, q.shape[0], decode, expanded, sm_scale=sm_scale,
                       block_kv=block_kv, block_q=block_q, decode_block_kv=decode_block_kv,
                       decode_rows=decode_rows)
    if absorbed_decode:
        dec = jnp.einsum("thr,rhv->thv", dec, w_uv)  # f32[T, H, Dv]: W_UV after
    return (dec + ctx).astype(q_nope.dtype)

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
from pallas_kernels.mla.reference import check_mla_shapes
from pallas_kernels.tuning import tuned

_NEG = -1e30  # running max of a row that has seen no key yet (finite: exp(_NEG - m) == 0)


def _latent_blocks(pool, slot, ids):
    """f32[n, p * page_size, W]: the latent rows of pages `ids` i32[n, p] of slot `slot`."""
    # NOTE: the indices pass a barrier, as in the GQA path: XLA otherwise fuses their
    # arithmetic into the gather and recomputes it for every gathered element.
    ids = jax.lax.optimization_barrier(ids)
    rows = pool[slot, 0, 0, ids]  # dtype[n, p, page_size, W(+4 if 8-bit)]
    return dequantize_kv(rows.reshape(ids.shape[0], -1, rows.shape[-1]))


def _pass(q, pool, slot, md, tiles, *, tq, pairs, block_kv, rank, sm_scale):
    """Outputs f32[T, H, R] of the tokens in `tiles` (zeros for the others).

    Args:
        q: f32[T, H, W] the queries [q_latent, q_pe].
        tiles: (seq, first, length) i32[n_tiles] each: a tile's request, its first token on
            the packed axis and its valid tokens (<= tq; 0 for unused tiles).
    """
    num_tokens, num_heads, width = q.shape
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
        logits = jnp.einsum("nqhw,ncw->nqhc", qt, lat) * sm_scale  # f32[n, tq, H, C]
        logits = jnp.where(mask, logits, _NEG)
        m_p = jnp.max(logits, axis=-1)  # f32[n, tq, H]
        p = jnp.where(mask, jnp.exp(logits - m_p[..., None]), 0.0)
        # NaN in a masked slot (free pages) must not leak through 0 * NaN.
        c_kv = jnp.where(keep[..., None], lat[..., :rank], 0.0)  # f32[n, C, R]
        acc_p = jnp.einsum("nqhc,ncr->nqhr", p, c_kv)  # f32[n, tq, H, R]
        acc, m, denom = state
        m_new = jnp.maximum(m, jnp.full_like(m, _NEG).at[t].max(m_p))
        scale, scale_p = jnp.exp(m - m_new), jnp.exp(m_p - m_new[t])
        acc = acc * scale[..., None] + jnp.zeros_like(acc).at[t].add(acc_p * scale_p[..., None])
        denom = denom * scale + jnp.zeros_like(denom).at[t].add(p.sum(-1) * scale_p)
        return acc, m_new, denom

    lead = (n_tiles, tq, num_heads)
    init = (jnp.zeros((*lead, rank), jnp.float32), jnp.full(lead, _NEG, jnp.float32),
            jnp.zeros(lead, jnp.float32))
    acc, _, denom = jax.lax.fori_loop(0, (total + pairs - 1) // pairs, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # f32[n_tiles, tq, H, R]
    tok = jnp.where(lane < length[:, None], first[:, None] + lane, num_tokens)  # dropped
    return jnp.zeros((num_tokens, num_heads, rank), jnp.float32).at[tok].set(out, mode="drop")


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
    t = tuned("mla_xla")
    page_size = pool.shape[4]
    whole = lambda n: max(page_size, n // page_size * page_size)  # noqa: E731
    block_kv = whole(t["block_kv"] if block_kv is None else block_kv)
    decode_block_kv = whole(t["decode_block_kv"] if decode_block_kv is None else decode_block_kv)
    block_q = t["block_q"] if block_q is None else block_q
    decode_rows = t["decode_rows"] if decode_rows is None else decode_rows
    num_tokens, _, rank = q_latent.shape
    num_seqs = md.kv_lens.shape[0]
    q = jnp.concatenate([q_latent, q_pe], axis=-1).astype(jnp.float32)  # f32[T, H, W]
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]  # i32[num_seqs]
    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    decode_tiles = (seqs, md.cu_q_lens[:-1], jnp.where(q_lens == 1, 1, 0))
    common = dict(rank=rank, sm_scale=sm_scale)
    out = _pass(q, pool, slot, md, decode_tiles, tq=1, pairs=min(decode_rows, num_seqs),
                block_kv=decode_block_kv, **common)
    ctx = _context_tiles(md, num_tokens, block_q)
    # NOTE: skipped at run time on decode steps (its tiles' loops and copies cost a
    # layer's worth of small ops for nothing there).
    out = out + jax.lax.cond(
        jnp.any(q_lens > 1),
        lambda: _pass(q, pool, slot, md, ctx, tq=block_q, pairs=1, block_kv=block_kv, **common),
        lambda: jnp.zeros_like(out))
    return out.astype(q_latent.dtype)

"""Pure-jnp paged decode attention: each request's single query over its gathered pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import dequantize_kv, is_quantized, kv_head_dim


def check_decode_shapes(q: jax.Array, kv_pages: jax.Array, block_tables: jax.Array,
                        kv_lens: jax.Array) -> None:
    """Raises ValueError naming the offending shapes when the inputs do not fit."""
    if q.ndim != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim], got shape {q.shape}")
    if kv_pages.ndim != 6 or kv_pages.shape[1] != 2:
        raise ValueError("kv_pages must be [num_layers, 2, num_kv_heads, num_pages, page_size, "
                         f"head_dim], got shape {kv_pages.shape}")
    if q.shape[2] != kv_head_dim(kv_pages) or q.shape[1] % kv_pages.shape[2]:
        raise ValueError(f"q {q.shape} does not fit kv_pages {kv_pages.shape}: head_dim must "
                         "match and num_q_heads be a multiple of num_kv_heads")
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0] or \
            kv_lens.shape != (q.shape[0],):
        raise ValueError(f"block_tables {block_tables.shape} and kv_lens {kv_lens.shape} must "
                         f"have one row per query of q {q.shape}")
    if q.dtype != kv_pages.dtype and not is_quantized(kv_pages.dtype):
        raise ValueError(f"q dtype {q.dtype} differs from kv_pages dtype {kv_pages.dtype}")


def paged_decode_attention_reference(q, kv_pages, layer, block_tables, kv_lens, *, sm_scale,
                                     sliding_window=0, soft_cap=None):
    """Attention of each request's last token over its whole paged context.

    Args:
        q: [num_seqs, num_q_heads, head_dim], the query at position kv_lens[i] - 1.
        kv_pages: dtype[num_layers, 2, num_kv_heads, num_pages, page_size, head_dim].
        layer: Layer index (may be traced).
        block_tables: i32[num_seqs, max_pages_per_seq].
        kv_lens: i32[num_seqs] context lengths; 0 marks a padded request (zero output).
        sm_scale, sliding_window, soft_cap: as in ragged paged attention.

    Returns:
        [num_seqs, num_q_heads, head_dim] in q's dtype.
    """
    check_decode_shapes(q, kv_pages, block_tables, kv_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[2], kv_pages.shape[4]
    max_ctx = block_tables.shape[1] * page_size
    kv = dequantize_kv(kv_pages[layer][:, :, block_tables])  # f32[2, Hkv, seqs, pages, page, D]
    kv = kv.reshape(2, num_kv_heads, num_seqs, max_ctx, head_dim)
    qg = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, -1, head_dim)
    logits = jnp.einsum("skgd,kscd->skgc", qg, kv[0]) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    pos = jnp.arange(max_ctx)[None, :]
    q_pos = kv_lens[:, None] - 1
    mask = pos < kv_lens[:, None]
    window = jnp.asarray(sliding_window, jnp.int32)
    mask &= (window <= 0) | (q_pos - pos < window)  # bool[num_seqs, max_ctx]
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask[:, None, None], probs, 0.0)  # padded requests: all-masked rows
    v = jnp.where(mask[None, :, :, None], kv[1], 0.0)
    out = jnp.einsum("skgc,kscd->skgd", probs, v)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)

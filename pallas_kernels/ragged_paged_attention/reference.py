"""Pure-jnp ragged paged attention, gathering K/V through block tables (the kernels' oracle).

Written for clarity, not speed: every query token gathers its own request's whole
context, so memory grows as num_tokens * max_context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import KV_CACHE_FLOATS, dequantize_kv, is_quantized, kv_head_dim
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.sinks import check_sinks, grouped_sinks, sink_factor

# Float pools any query may read where every gathered page is widened to float32 (this
# reference and the XLA path): the float `kv_cache_dtype`s' pools. The Pallas kernels read
# pools of q's own dtype.
WIDENED_POOLS = tuple(KV_CACHE_FLOATS.values())


def check_shapes(q: jax.Array, kv_pages: jax.Array, md: AttentionMetadata,
                 widens: bool = False) -> None:
    """Raises ValueError naming the offending shapes when inputs do not fit together.

    `widens`: the caller widens pages to float32, so a float pool (`WIDENED_POOLS`) of
    another dtype than q's is fine (the CPU's float16/bfloat16 pools under float32 queries).
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if kv_pages.ndim != 6 or kv_pages.shape[1] != 2:
        raise ValueError("kv_pages must be [num_layers, 2, num_kv_heads, num_pages, page_size, "
                         f"head_dim], got shape {kv_pages.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pages.shape[2]
    if kv_head_dim(kv_pages) != head_dim:
        raise ValueError(f"head_dim of q {q.shape} and kv_pages {kv_pages.shape} differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} (q {q.shape}) is not a multiple of "
                         f"num_kv_heads {num_kv_heads} (kv_pages {kv_pages.shape})")
    num_seqs = md.kv_lens.shape[0]
    if md.block_tables.ndim != 2 or md.block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {md.block_tables.shape} must be [num_seqs={num_seqs}, "
                         "max_pages_per_seq]")
    if md.cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens {md.cu_q_lens.shape} must be [num_seqs + 1 = "
                         f"{num_seqs + 1}] for kv_lens {md.kv_lens.shape}")
    if md.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {md.slot_mapping.shape} must be [num_tokens = "
                         f"{num_tokens}] for q {q.shape}")
    if md.q_span_end is not None and md.q_span_end.shape != (num_tokens,):
        raise ValueError(f"q_span_end {md.q_span_end.shape} must be [num_tokens = "
                         f"{num_tokens}] for q {q.shape}")
    for name in ("slot_mapping", "block_tables", "kv_lens", "cu_q_lens") + (
            ("q_span_end",) if md.q_span_end is not None else ()):
        dtype = getattr(md, name).dtype
        if dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {dtype}")
    widened = widens and kv_pages.dtype in WIDENED_POOLS
    if q.dtype != kv_pages.dtype and not is_quantized(kv_pages.dtype) and not widened:
        raise ValueError(f"q dtype {q.dtype} differs from kv_pages dtype {kv_pages.dtype}")


def token_positions(md: AttentionMetadata, num_tokens: int):
    """Maps each packed token to its request and its absolute position in that request.

    Returns:
        seq_ids: i32[num_tokens] request index of each token (clamped for padded tokens).
        q_pos: i32[num_tokens] absolute position of the token in its request's context.
        valid: bool[num_tokens] False for padded tokens.
    """
    num_seqs = md.kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_ids = jnp.searchsorted(md.cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = t < md.cu_q_lens[num_seqs]
    seq_ids = jnp.minimum(seq_ids, num_seqs - 1)
    q_start = md.cu_q_lens[seq_ids]
    q_len = md.cu_q_lens[seq_ids + 1] - q_start
    q_pos = md.kv_lens[seq_ids] - q_len + (t - q_start)
    return seq_ids, q_pos, valid


def causal_limit(md: AttentionMetadata, q_pos: jax.Array) -> jax.Array:
    """i32[num_tokens]: the last key position each query sees: its own, or the last of its
    bidirectional span (`md.q_span_end`) when it sits in one."""
    if md.q_span_end is None:
        return q_pos
    return jnp.maximum(q_pos, md.q_span_end - 1)


def chunk_start(q_pos, chunk_size):
    """i32 (q_pos's shape): the first key of the attention chunk of queries at `q_pos`,
    floor(q_pos / chunk) * chunk; 0 for a chunk <= 0 (none)."""
    chunk = jnp.asarray(chunk_size, jnp.int32)
    return jnp.where(chunk > 0, q_pos - q_pos % jnp.maximum(chunk, 1), 0)


def chunk_ok(q_pos, k_pos, chunk_size):
    """bool[...]: keys at `k_pos` in the attention chunk of queries at `q_pos` (broadcast;
    keys from floor(q_pos / chunk) * chunk on; a chunk of 0 masks nothing)."""
    return k_pos >= chunk_start(q_pos, chunk_size)


def ragged_paged_attention_reference(
    q: jax.Array,
    kv_pages: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: jax.Array | int = 0,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    chunk_size: jax.Array | int = 0,
) -> jax.Array:
    """Causal attention of packed queries over each request's paged K/V.

    Args:
        q: [num_tokens, num_q_heads, head_dim] queries (rotary already applied).
        kv_pages: dtype[num_layers, 2, num_kv_heads, num_pages, page_size, head_dim].
        layer: Layer index into the pool (may be traced).
        md: Attention metadata of this step.
        sm_scale: Scale applied to q.k.
        sliding_window: Keys older than `window` positions are masked; 0 means none.
        soft_cap: If set, logits become `soft_cap * tanh(logits / soft_cap)`.
        sinks: f32[num_q_heads] learned sink logits (`pallas_kernels.sinks`): each row's
            softmax gets one more column holding its head's sink, which takes mass but adds
            no value. None: no sinks.
        chunk_size: Chunked local attention (Llama 4; may be traced): a query at position p
            sees keys from floor(p / chunk_size) * chunk_size on; 0 means none.

    A query inside a bidirectional span (`md.q_span_end`) also sees the span's later keys.

    Returns:
        [num_tokens, num_q_heads, head_dim] outputs in q's dtype; padded tokens are zero.
    """
    check_shapes(q, kv_pages, md, widens=True)
    check_sinks(sinks, q.shape[1])
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[2], kv_pages.shape[4]
    group = num_q_heads // num_kv_heads
    max_ctx = md.block_tables.shape[1] * page_size

    seq_ids, q_pos, valid = token_positions(md, num_tokens)
    pages = md.block_tables[seq_ids]  # i32[num_tokens, max_pages_per_seq]
    # kv: [2, num_kv_heads, num_tokens, max_pages_per_seq, page_size, head_dim]
    kv = dequantize_kv(kv_pages[layer][:, :, pages])
    kv = kv.reshape(2, num_kv_heads, num_tokens, max_ctx, head_dim)
    k, v = kv[0], kv[1]

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    logits = jnp.einsum("tkgd,ktcd->tkgc", qg, k) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    kv_pos = jnp.arange(max_ctx, dtype=jnp.int32)[None, :]  # [1, max_ctx]
    hi = causal_limit(md, q_pos)  # i32[num_tokens]
    mask = (kv_pos < md.kv_lens[seq_ids][:, None]) & (kv_pos <= hi[:, None])
    window = jnp.asarray(sliding_window, jnp.int32)
    mask &= (window <= 0) | (q_pos[:, None] - kv_pos < window)
    mask &= chunk_ok(q_pos[:, None], kv_pos, chunk_size)
    mask &= valid[:, None]  # bool[num_tokens, max_ctx]

    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask[:, None, None, :], jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    if sinks is not None:  # [1, k, g, 1] sink of each query head
        probs = probs * sink_factor(row_max, denom,
                                    grouped_sinks(sinks, num_kv_heads)[None, :, :, None])
    # NaN in a masked slot must not leak through 0 * NaN: zero masked values first.
    v = jnp.where(mask[None, :, :, None], v, 0.0)
    out = jnp.einsum("tkgc,ktcd->tkgd", probs, v)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

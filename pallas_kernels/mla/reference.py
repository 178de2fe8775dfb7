"""Pure-jnp MLA over latent pages (the definition its XLA path and Pallas kernel are tested
against), the latent write, and the expanded-form oracle the absorbed form is checked with.

A latent pool is an ordinary page pool (`pallas_kernels.metadata`) with one K/V entry and
one head: dtype[num_slots, 1, 1, num_pages, page_size, R + Dr], each token's row holding
its normalised compressed KV c_kv ([:R], `kv_lora_rank`) then its roped key part k_pe
([R:], `qk_rope_head_dim`). Page plans, swap and prefix sharing move these rows like any.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import dequantize_kv, is_quantized, kv_head_dim, quantize_kv
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ragged_paged_attention.reference import (
    WIDENED_POOLS,
    ragged_paged_attention_reference,
    token_positions,
)


def check_latent_pool(pool: jax.Array) -> None:
    """Raises ValueError unless `pool` is [num_slots, 1, 1, num_pages, page_size, width]."""
    if pool.ndim != 6 or pool.shape[1:3] != (1, 1):
        raise ValueError("pool must be a latent pool [num_slots, 1, 1, num_pages, page_size, "
                         f"kv_lora_rank + qk_rope_head_dim], got shape {pool.shape}")


def check_mla_shapes(q_latent: jax.Array, q_pe: jax.Array, pool: jax.Array,
                     md: AttentionMetadata, widens: bool = False) -> None:
    """Raises ValueError naming the argument whose shape or dtype does not fit.

    `widens`: the caller widens pages to float32, so a float pool of another dtype than the
    queries' is fine (as `check_shapes`).
    """
    check_latent_pool(pool)
    if q_latent.ndim != 3:
        raise ValueError(f"q_latent must be [num_tokens, num_heads, kv_lora_rank], got shape "
                         f"{q_latent.shape}")
    num_tokens, num_heads, rank = q_latent.shape
    if q_pe.ndim != 3 or q_pe.shape[:2] != (num_tokens, num_heads):
        raise ValueError(f"q_pe must be [num_tokens={num_tokens}, num_heads={num_heads}, "
                         f"qk_rope_head_dim], got shape {q_pe.shape}")
    if kv_head_dim(pool) != rank + q_pe.shape[2]:
        raise ValueError(f"pool {pool.shape} rows hold {kv_head_dim(pool)} values, not "
                         f"kv_lora_rank + qk_rope_head_dim = {rank} + {q_pe.shape[2]} "
                         f"(q_latent {q_latent.shape}, q_pe {q_pe.shape})")
    if q_pe.dtype != q_latent.dtype:
        raise ValueError(f"q_pe dtype {q_pe.dtype} differs from q_latent dtype {q_latent.dtype}")
    num_seqs = md.kv_lens.shape[0]
    if md.block_tables.ndim != 2 or md.block_tables.shape[0] != num_seqs:
        raise ValueError(f"md.block_tables {md.block_tables.shape} must be [num_seqs="
                         f"{num_seqs}, max_pages_per_seq]")
    if md.cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"md.cu_q_lens {md.cu_q_lens.shape} must be [num_seqs + 1 = "
                         f"{num_seqs + 1}] for md.kv_lens {md.kv_lens.shape}")
    if md.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"md.slot_mapping {md.slot_mapping.shape} must be [num_tokens = "
                         f"{num_tokens}] for q_latent {q_latent.shape}")
    for name in ("slot_mapping", "block_tables", "kv_lens", "cu_q_lens"):
        if getattr(md, name).dtype != jnp.int32:
            raise ValueError(f"md.{name} must be int32, got {getattr(md, name).dtype}")
    widened = widens and pool.dtype in WIDENED_POOLS
    if q_latent.dtype != pool.dtype and not is_quantized(pool.dtype) and not widened:
        raise ValueError(f"q_latent dtype {q_latent.dtype} differs from pool dtype {pool.dtype}")


def check_expanded_shapes(q_nope: jax.Array, q_pe: jax.Array, pool: jax.Array,
                          md: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array) -> None:
    """Raises ValueError naming the argument of the expanded form whose shape does not fit
    (then `check_mla_shapes` on the absorbed queries it stands for, q_nope W_UK^T)."""
    if q_nope.ndim != 3:
        raise ValueError(f"q_nope must be [num_tokens, num_heads, qk_nope_head_dim], got "
                         f"shape {q_nope.shape}")
    num_heads, dn = q_nope.shape[1:]
    if w_uk.ndim != 3 or w_uk.shape[1:] != (num_heads, dn):
        raise ValueError(f"w_uk must be [kv_lora_rank, num_heads={num_heads}, "
                         f"qk_nope_head_dim={dn}], got shape {w_uk.shape}")
    if w_uv.ndim != 3 or w_uv.shape[:2] != w_uk.shape[:2]:
        raise ValueError(f"w_uv must be [kv_lora_rank={w_uk.shape[0]}, num_heads={num_heads}, "
                         f"v_head_dim], got shape {w_uv.shape}")
    q_latent = jax.ShapeDtypeStruct((q_nope.shape[0], num_heads, w_uk.shape[0]), q_nope.dtype)
    check_mla_shapes(q_latent, q_pe, pool, md, widens=True)


def latent_rows(pool: jax.Array, latent: jax.Array) -> jax.Array:
    """This step's latents [T, R + Dr] as the pool stores them: cast, or quantized rows
    (codes then the f32 scale bytes, one scale for the token's whole row) in an 8-bit pool.

    Raises:
        ValueError: `latent` is not [num_tokens, the pool's row width].
    """
    check_latent_pool(pool)
    if latent.ndim != 2 or latent.shape[1] != kv_head_dim(pool):
        raise ValueError(f"latent must be [num_tokens, {kv_head_dim(pool)}] (kv_lora_rank + "
                         f"qk_rope_head_dim) for pool {pool.shape}, got shape {latent.shape}")
    if is_quantized(pool.dtype):
        return quantize_kv(latent, pool.dtype)
    return latent.astype(pool.dtype)


def write_latent_reference(pool: jax.Array, slot, latent: jax.Array,
                           slot_mapping: jax.Array) -> jax.Array:
    """Writes this step's latents into slot `slot` of a latent pool.

    Args:
        pool: dtype[num_slots, 1, 1, num_pages, page_size, R + Dr].
        slot: The layer's slot (may be traced).
        latent: f32/bf16[num_tokens, R + Dr]: c_kv (normalised) then k_pe (roped).
        slot_mapping: i32[num_tokens] page_id * page_size + offset; slots in the null page
            (padded tokens carry 0) are dropped, as in `write_kv_reference`.

    Returns:
        The updated pool (same shape and dtype).
    """
    rows = latent_rows(pool, latent)  # dtype[T, width]
    if slot_mapping.shape != (latent.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32[num_tokens = {latent.shape[0]}], got "
                         f"{slot_mapping.dtype}{list(slot_mapping.shape)}")
    num_pages, page_size = pool.shape[3], pool.shape[4]
    page_ids = slot_mapping // page_size  # i32[T]
    page_ids = jnp.where(page_ids > 0, page_ids, num_pages)  # out of range -> dropped
    return pool.at[slot, 0, 0, page_ids, slot_mapping % page_size].set(rows, mode="drop")


def mla_attention_reference(q_latent: jax.Array, q_pe: jax.Array, pool: jax.Array, slot,
                            md: AttentionMetadata, *, sm_scale: float) -> jax.Array:
    """Absorbed-form MLA: causal attention of packed queries over each request's latents.

    Per token and head: scores over the request's keys j up to the token's position are
    `sm_scale * (q_latent . c_kv[j] + q_pe . k_pe[j])`; the output is the softmax-weighted
    sum of c_kv[j], in latent space (the caller applies W_UV). Every token gathers its
    request's whole block table: written for clarity, not speed.

    Args:
        q_latent: [num_tokens, num_heads, R] queries absorbed into latent space (q_nope W_UK).
        q_pe: [num_tokens, num_heads, Dr] roped query parts.
        pool: dtype[num_slots, 1, 1, num_pages, page_size, R + Dr] (this step's latents
            already written).
        slot: The layer's slot (may be traced).
        md: This step's metadata (any packing; padded tokens give zeros).
        sm_scale: Scale of the scores (DeepSeek: qk_head_dim ** -0.5 times the YaRN mscale^2).

    Returns:
        [num_tokens, num_heads, R] in q_latent's dtype.
    """
    check_mla_shapes(q_latent, q_pe, pool, md, widens=True)
    num_tokens, _, rank = q_latent.shape
    page_size = pool.shape[4]
    max_ctx = md.block_tables.shape[1] * page_size
    seq_ids, q_pos, valid = token_positions(md, num_tokens)
    pages = md.block_tables[seq_ids]  # i32[T, max_pages_per_seq]
    lat = dequantize_kv(pool[slot, 0, 0][pages]).reshape(num_tokens, max_ctx, -1)  # f32[T, C, W]
    q = jnp.concatenate([q_latent, q_pe], axis=-1).astype(jnp.float32)  # f32[T, H, W]
    logits = jnp.einsum("thw,tcw->thc", q, lat) * sm_scale  # f32[T, H, C]
    kv_pos = jnp.arange(max_ctx, dtype=jnp.int32)[None, :]  # i32[1, C]
    mask = (kv_pos < md.kv_lens[seq_ids][:, None]) & (kv_pos <= q_pos[:, None])
    mask &= valid[:, None]  # bool[T, C]
    logits = jnp.where(mask[:, None, :], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask[:, None, :], jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    # NaN in a masked slot must not leak through 0 * NaN: zero masked values first.
    c_kv = jnp.where(mask[:, :, None], lat[..., :rank], 0.0)  # f32[T, C, R]
    return jnp.einsum("thc,tcr->thr", probs, c_kv).astype(q_latent.dtype)


def mla_expanded_reference(q_nope: jax.Array, q_pe: jax.Array, pool: jax.Array, slot,
                           md: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array, *,
                           sm_scale: float) -> jax.Array:
    """Expanded-form MLA, the oracle of the absorbed form: per-head keys and values are
    rebuilt from the latents and attended as ordinary multi-head attention
    (`ragged_paged_attention_reference` over an expanded pool).

    K_h = [c_kv W_UK[:, h], k_pe], V_h = c_kv W_UV[:, h]; the absorbed form's output times
    W_UV equals this one, with q_latent = q_nope W_UK^T per head.

    Args:
        q_nope: [T, H, Dn] the query parts without rotary.
        q_pe: [T, H, Dr] roped query parts.
        pool: A latent pool (see `mla_attention_reference`).
        slot: The layer's slot.
        md: This step's metadata.
        w_uk: [R, H, Dn] the key up-projection (kv_b_proj's key columns).
        w_uv: [R, H, Dv] the value up-projection (kv_b_proj's value columns).
        sm_scale: Scale of the scores.

    Returns:
        f32[T, H, Dv].
    """
    rank = w_uk.shape[0]
    lat = dequantize_kv(pool[slot, 0, 0])  # f32[num_pages, page_size, R + Dr]
    c_kv, k_pe = lat[..., :rank], lat[..., rank:]
    num_heads, dn, dv = w_uk.shape[1], w_uk.shape[2], w_uv.shape[2]
    width = dn + k_pe.shape[-1]
    k = jnp.concatenate([jnp.einsum("psr,rhd->hpsd", c_kv, w_uk),
                         jnp.broadcast_to(k_pe[None], (num_heads, *k_pe.shape))], axis=-1)
    v = jnp.einsum("psr,rhd->hpsd", c_kv, w_uv)  # f32[H, P, ps, Dv]
    v = jnp.pad(v, ((0, 0),) * 3 + ((0, width - dv),))  # to K's width (a pool has one)
    expanded = jnp.stack([k, v])[None]  # f32[1, 2, H, P, ps, Dn + Dr]
    q = jnp.concatenate([q_nope, q_pe], axis=-1).astype(jnp.float32)  # f32[T, H, Dn + Dr]
    out = ragged_paged_attention_reference(q, expanded, 0, md, sm_scale=sm_scale)
    return out[..., :dv]

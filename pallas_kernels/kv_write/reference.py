"""Pure-jnp KV write: scatter new K/V into one layer of the page pool by slot mapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import pack_for_pool


def check_kv_write_shapes(kv_pages: jax.Array, k: jax.Array, v: jax.Array,
                          slot_mapping: jax.Array) -> None:
    """Raises ValueError naming the offending shapes when the inputs do not fit."""
    if kv_pages.ndim != 6 or kv_pages.shape[1] != 2:
        raise ValueError("kv_pages must be [num_layers, 2, num_kv_heads, num_pages, page_size, "
                         f"head_dim], got shape {kv_pages.shape}")
    want = (slot_mapping.shape[0], kv_pages.shape[2], kv_pages.shape[5])
    if k.shape != want or v.shape != want:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [num_tokens, num_kv_heads, "
                         f"head_dim] = {want} for kv_pages {kv_pages.shape} and slot_mapping "
                         f"{slot_mapping.shape}")
    if slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32, got {slot_mapping.dtype}")


def write_kv_reference(kv_pages: jax.Array, layer: jax.Array | int, k: jax.Array,
                       v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Writes K and V of this step's tokens into layer `layer` of the pool.

    Args:
        kv_pages: dtype[num_layers, 2, num_kv_heads, num_pages, page_size, head_dim].
        layer: Layer index (may be traced).
        k: [num_tokens, num_kv_heads, head_dim] new keys.
        v: [num_tokens, num_kv_heads, head_dim] new values.
        slot_mapping: i32[num_tokens] flat slot (page_id * page_size + offset). Slots in
            the null page (padded tokens carry slot 0) are dropped: nothing is written.

    Returns:
        The updated pool (same shape and dtype). An 8-bit pool (`pallas_kernels.kv_quant`)
        receives each row quantized with its scale.
    """
    k, v = pack_for_pool(kv_pages, k, v)
    check_kv_write_shapes(kv_pages, k, v, slot_mapping)
    num_pages, page_size = kv_pages.shape[3], kv_pages.shape[4]
    page_ids = slot_mapping // page_size  # i32[num_tokens]
    page_ids = jnp.where(page_ids > 0, page_ids, num_pages)  # out of range -> dropped
    offsets = slot_mapping % page_size  # i32[num_tokens]
    kv = jnp.stack([k, v]).astype(kv_pages.dtype)  # [2, num_tokens, num_kv_heads, head_dim]
    # Advanced indices (page_ids, offsets) are split from the K/V axis by a slice, so the
    # indexed view has shape [num_tokens, 2, num_kv_heads, head_dim].
    return kv_pages.at[layer, :, :, page_ids, offsets].set(jnp.swapaxes(kv, 0, 1), mode="drop")

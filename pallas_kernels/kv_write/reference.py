"""Pure-jnp KV write: scatter new K/V into one layer of the page pool by slot mapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv_reference(kv_pages: jax.Array, layer: jax.Array | int, k: jax.Array,
                       v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Writes K and V of this step's tokens into layer `layer` of the pool.

    Args:
        kv_pages: dtype[num_layers, 2, num_kv_heads, num_pages, page_size, head_dim].
        layer: Layer index (may be traced).
        k: [num_tokens, num_kv_heads, head_dim] new keys.
        v: [num_tokens, num_kv_heads, head_dim] new values.
        slot_mapping: i32[num_tokens] flat slot (page_id * page_size + offset); padded
            tokens carry slot 0, inside the null page.

    Returns:
        The updated pool (same shape and dtype).
    """
    page_size = kv_pages.shape[4]
    page_ids = slot_mapping // page_size  # i32[num_tokens]
    offsets = slot_mapping % page_size  # i32[num_tokens]
    kv = jnp.stack([k, v]).astype(kv_pages.dtype)  # [2, num_tokens, num_kv_heads, head_dim]
    # Advanced indices (page_ids, offsets) are split from the K/V axis by a slice, so the
    # indexed view has shape [num_tokens, 2, num_kv_heads, head_dim].
    return kv_pages.at[layer, :, :, page_ids, offsets].set(jnp.swapaxes(kv, 0, 1))

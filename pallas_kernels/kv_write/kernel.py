"""KV write as a Pallas kernel: one program per token scatters its K/V rows into the pool.

The pool is aliased to the output (`input_output_aliases`), so under jit with donation
it is updated in place. Tokens whose slot lies in the null page (padding) write nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kv_quant import pack_for_pool
from pallas_kernels.kv_write.reference import check_kv_write_shapes


def _kernel(layer_ref, slots_ref, k_ref, v_ref, kv_in_ref, kv_ref, *, num_kv_heads,
            num_pages, page_size):
    del kv_in_ref  # aliased to kv_ref
    t = pl.program_id(0)
    slot = slots_ref[t]

    @pl.when(slot >= page_size)  # slots 0..page_size-1 are the null page
    def _():
        heads = jnp.arange(num_kv_heads, dtype=jnp.int32)
        layer_base = layer_ref[0] * 2 * num_kv_heads
        k_rows = ((layer_base + heads) * num_pages * page_size) + slot  # i32[num_kv_heads]
        v_rows = k_rows + num_kv_heads * num_pages * page_size
        kv_ref[k_rows] = k_ref[t].astype(kv_ref.dtype)
        kv_ref[v_rows] = v_ref[t].astype(kv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_kernel(kv_pages: jax.Array, layer, k: jax.Array, v: jax.Array,
                    slot_mapping: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Pallas KV write; same contract as `write_kv_reference` (the pool is donated).

    For an 8-bit pool the rows are quantized (codes + scale) before the kernel copies them.
    """
    k, v = pack_for_pool(kv_pages, k, v)
    check_kv_write_shapes(kv_pages, k, v, slot_mapping)
    shape = kv_pages.shape
    num_kv_heads, num_pages, page_size, head_dim = shape[2], shape[3], shape[4], shape[5]
    rows = kv_pages.reshape(-1, head_dim)  # one row per (layer, k/v, head, slot)
    whole = pl.BlockSpec()
    kernel = functools.partial(_kernel, num_kv_heads=num_kv_heads, num_pages=num_pages,
                               page_size=page_size)
    out = pl.pallas_call(
        kernel,
        grid=(slot_mapping.shape[0],),
        in_specs=[whole] * 5,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        input_output_aliases={4: 0},
        interpret=interpret,
        # NOTE: Triton explicitly; JAX 0.10 would otherwise pick Mosaic GPU, which stages
        # whole-array refs (the page pool) in shared memory.
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=2),
        name="kv_write_per_token",
    )(jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping, k, v, rows)
    return out.reshape(shape)

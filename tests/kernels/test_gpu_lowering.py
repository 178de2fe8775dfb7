"""The Pallas kernels lower for the GPU (Triton) from this CPU-only machine.

Cross-platform lowering runs the Pallas-to-Triton lowering without a GPU, so an op the
Triton path cannot express fails here, in CI, not first on a lent accelerator. (Triton's
own compile to PTX still needs a GPU.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import AttentionMetadata
from pallas_kernels.kv_write.kernel import write_kv_kernel
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention_kernel
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention_kernel


def i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("page_size,group,head_dim", [(16, 2, 128), (8, 3, 64), (32, 1, 64)])
def test_kernels_lower_to_triton(page_size, group, head_dim, dtype):
    num_layers, num_kv_heads, num_pages, num_seqs, num_tokens, width = 2, 2, 32, 4, 32, 8
    kv = jax.ShapeDtypeStruct((num_layers, 2, num_kv_heads, num_pages, page_size, head_dim),
                              dtype)
    q = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), dtype)
    dq = jax.ShapeDtypeStruct((num_seqs, num_kv_heads * group, head_dim), dtype)
    new = jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_dim), dtype)
    md = AttentionMetadata(i32(num_tokens), i32(num_seqs, width), i32(num_seqs),
                           i32(num_seqs + 1))
    cases = [
        (functools.partial(ragged_paged_attention_kernel, sm_scale=0.1, soft_cap=30.0,
                           pages_per_block=max(1, 32 // page_size)), (q, kv, 0, md)),
        (functools.partial(paged_decode_attention_kernel, sm_scale=0.1,
                           pages_per_block=max(1, 32 // page_size), num_splits=2),
         (dq, kv, 0, i32(num_seqs, width), i32(num_seqs))),
        (write_kv_kernel, (kv, 0, new, new, i32(num_tokens))),
    ]
    for fn, args in cases:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text().lower()


def test_kernels_lower_to_triton_through_a_group_view():
    # A hybrid KV cache's step: the layer's pool slot and KV cache group are traced (the
    # layer scan's), and each kernel gets its group's 2-D view of the grouped metadata.
    num_groups, num_slots, num_seqs, num_tokens, width = 3, 2, 4, 32, 8
    kv = jax.ShapeDtypeStruct((num_slots, 2, 2, 32, 16, 64), "float32")
    q = jax.ShapeDtypeStruct((num_tokens, 4, 64), "float32")
    new = jax.ShapeDtypeStruct((num_tokens, 2, 64), "float32")
    md = AttentionMetadata(i32(num_groups, num_tokens), i32(num_groups, num_seqs, width),
                           i32(num_seqs), i32(num_seqs + 1))

    def step(q, kv, new, slot, group, window, md):
        view = md.for_group(group)
        kv = write_kv_kernel(kv, slot, new, new, view.slot_mapping)
        out = ragged_paged_attention_kernel(q, kv, slot, view, sm_scale=0.1,
                                            sliding_window=window, pages_per_block=2)
        dec = paged_decode_attention_kernel(q[:num_seqs], kv, slot, view.block_tables,
                                            view.kv_lens, sm_scale=0.1,
                                            sliding_window=window, pages_per_block=2,
                                            num_splits=2)
        return kv, out, dec

    lowered = jax.jit(step).trace(q, kv, new, i32(), i32(), i32(), md).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().lower().count("triton") >= 3


def test_kernels_lower_to_triton_with_a_traced_chunk():
    # Llama 4's chunked layers: the chunk (and the window) come from the layer scan's window
    # table, so the kernels take them as traced scalars.
    num_seqs, num_tokens, width = 4, 32, 8
    kv = jax.ShapeDtypeStruct((2, 2, 2, 32, 16, 64), "bfloat16")
    q = jax.ShapeDtypeStruct((num_tokens, 4, 64), "bfloat16")
    md = AttentionMetadata(i32(num_tokens), i32(num_seqs, width), i32(num_seqs),
                           i32(num_seqs + 1))

    def step(q, kv, slot, window, chunk, md):
        out = ragged_paged_attention_kernel(q, kv, slot, md, sm_scale=0.1, sliding_window=window,
                                            pages_per_block=2, chunk_size=chunk)
        dec = paged_decode_attention_kernel(q[:num_seqs], kv, slot, md.block_tables, md.kv_lens,
                                            sm_scale=0.1, sliding_window=window,
                                            pages_per_block=2, num_splits=2, chunk_size=chunk)
        return out, dec

    lowered = jax.jit(step).trace(q, kv, i32(), i32(), i32(), md).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().lower().count("triton") >= 2

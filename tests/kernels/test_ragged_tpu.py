"""The TPU (Mosaic) ragged kernel: TPU interpreter against the reference, and Mosaic lowering.

The TPU interpreter is slow on the CPU (seconds per call), so shapes stay tiny.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionMetadata
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels.cases import Geometry, make_metadata, make_pool, slow_except, tolerance

CASES = [  # geometry, q_lens, kv_lens, window, soft_cap
    (Geometry(8, 2, 3, 64, num_tokens=16, num_seqs=3, width=4, num_pages=16),
     [1, 6, 3], [9, 6, 20], 4, None),
    (Geometry(16, 1, 2, 128, "bfloat16", num_tokens=8, num_seqs=4, width=2, num_pages=12),
     [1, 1, 1, 0], [17, 3, 32, 0], 0, 20.0),
]


# NOTE: the interpreter compiles ~60 programs per case. The first case's geometry, lengths
# and window run on an int8 pool in test_kv_quant.py::test_tpu_kernel_on_int8_pool_in_
# interpreter (default tier), so here it runs in the slow tier.
@pytest.mark.parametrize("g,q_lens,kv_lens,window,soft_cap", slow_except(CASES, 1),
                         ids=[str(c[0]) for c in CASES])
def test_tpu_kernel_matches_reference_in_interpreter(g, q_lens, kv_lens, window, soft_cap):
    rng = np.random.default_rng(0)
    kv_pages, tables = make_pool(g, kv_lens, rng)  # free and null pages hold NaN
    md = make_metadata(g, q_lens, kv_lens, tables)
    q = jnp.asarray(rng.standard_normal((g.num_tokens, g.num_q_heads, g.head_dim)), g.dtype)
    want = np.asarray(ragged_paged_attention_reference(
        q, kv_pages, 1, md, sm_scale=0.125, sliding_window=window, soft_cap=soft_cap),
        np.float32)
    got = np.asarray(ragged_paged_attention_tpu(
        q, kv_pages, 1, md, sm_scale=0.125, sliding_window=window, soft_cap=soft_cap,
        block_q=8, pages_per_block=2, interpret=True), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)


@pytest.mark.parametrize("dtype,page_size,head_dim", [("bfloat16", 16, 128),
                                                      ("float32", 8, 64)])
def test_tpu_kernel_lowers_to_mosaic(fake_tpu_info, dtype, page_size, head_dim):
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    q = jax.ShapeDtypeStruct((32, 4, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, 2, 2, 32, page_size, head_dim), dtype)
    md = AttentionMetadata(i32(32), i32(4, 8), i32(4), i32(5))
    fn = functools.partial(ragged_paged_attention_tpu, sm_scale=0.1, soft_cap=30.0)
    lowered = jax.jit(fn).trace(q, kv, 0, md).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


def test_tpu_kernel_lowers_through_a_group_view(fake_tpu_info):
    # A hybrid KV cache's step: the pool slot and the KV cache group traced (the layer
    # scan's), the kernel given its group's 2-D view of the grouped metadata.
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    q = jax.ShapeDtypeStruct((32, 4, 128), "bfloat16")
    kv = jax.ShapeDtypeStruct((2, 2, 2, 32, 16, 128), "bfloat16")
    md = AttentionMetadata(i32(3, 32), i32(3, 4, 8), i32(4), i32(5))

    def step(q, kv, slot, group, window, md):
        return ragged_paged_attention_tpu(q, kv, slot, md.for_group(group), sm_scale=0.1,
                                          sliding_window=window)

    lowered = jax.jit(step).trace(q, kv, i32(), i32(), i32(), md).lower(
        lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


def test_tpu_kernel_lowers_with_a_traced_chunk(fake_tpu_info):
    # Llama 4's chunked layers: the chunk is a traced third prefetched scalar (each row's
    # chunk start, a vector remainder, is computed once per program, outside the key loop).
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    q = jax.ShapeDtypeStruct((32, 4, 128), "bfloat16")
    kv = jax.ShapeDtypeStruct((2, 2, 2, 32, 16, 128), "bfloat16")
    md = AttentionMetadata(i32(32), i32(4, 8), i32(4), i32(5))

    def step(q, kv, slot, chunk, md):
        return ragged_paged_attention_tpu(q, kv, slot, md, sm_scale=0.1, chunk_size=chunk)

    lowered = jax.jit(step).trace(q, kv, i32(), i32(), md).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()

"""Ragged paged attention: the Pallas kernel (interpret mode) against the jnp reference."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pallas_kernels import AttentionMetadata, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.kernel import (
    query_blocks,
    ragged_paged_attention_kernel,
)
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels.cases import Geometry, make_metadata, make_pool, slow_except, tolerance

# Together these cover page sizes 8/16/32, GQA 1/2/3/4/8, head_dim 64/128, f32 and bf16.
GEOMETRIES = [
    Geometry(8, 2, 1, 64),
    Geometry(16, 2, 2, 128),
    Geometry(32, 1, 4, 64, "bfloat16", width=2),
    Geometry(16, 3, 3, 64),
    Geometry(8, 1, 8, 128, "bfloat16"),
]
# (q_lens, kv_lens) of 4 requests on 32 token slots.
BATCHES = {
    "decode_only": ([1, 1, 1, 1], [5, 17, 33, 1]),
    "prefill_only_padded": ([13, 7, 0, 0], [13, 7, 0, 0]),  # 2 padded requests, 12 tokens
    "mixed_mid_page_chunks": ([1, 9, 1, 12], [20, 14, 40, 31]),
    "full": ([8, 8, 8, 8], [8, 16, 30, 57]),
}
SM_SCALE = 0.125

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))
# NOTE: calls pass `sliding_window` even when it is 0: an omitted one is a constant of the
# program, a passed one an argument, so calls with and without a window share a compile.


def _inputs(g: Geometry, batch: str, seed=0, poison=np.nan):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = BATCHES[batch]
    kv_lens = [min(k, g.width * g.page_size) for k in kv_lens]
    kv_pages, tables = make_pool(g, kv_lens, rng, poison)
    md = make_metadata(g, q_lens, kv_lens, tables)
    q = rng.standard_normal((g.num_tokens, g.num_q_heads, g.head_dim)).astype(g.dtype)
    return q, kv_pages, md


@functools.cache
def _kernel(block_q: int, pages_per_block: int):
    return functools.partial(ragged_paged_attention_kernel, block_q=block_q,
                             pages_per_block=pages_per_block, interpret=True)


# NOTE: one compile per geometry (batches and windows are data). The default tier keeps
# GQA 1 (page size 8), a padded group (3 query heads per KV head: 4 rows) and bf16 with
# head_dim 128 and GQA 8; the other two (GQA 2, and GQA 4 with page size 32) in the slow tier.
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("g", slow_except(GEOMETRIES, 0, 3, 4), ids=str)
def test_kernel_matches_reference(g, batch, window):
    q, kv_pages, md = _inputs(g, batch)
    want = np.asarray(reference(q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=window),
                      np.float32)
    got = np.asarray(_kernel(16, max(1, 32 // g.page_size))(
        q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=window), np.float32)
    assert np.isfinite(want).all() and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)
    padded = int(np.asarray(md.cu_q_lens)[-1])
    assert not got[padded:].any(), "padded tokens must produce zeros"


# NOTE: each (tiling, cap) is a compile: the default tier runs the odd tiling (3 pages a
# block: the table padded) with the cap; uncapped, the kernel runs in
# test_kernel_matches_reference (tiles of 16), and tiles of 8 on 8-bit pools in
# test_kv_quant.py.
@pytest.mark.parametrize("block_q,pages_per_block,soft_cap",
                         slow_except([(8, 1, None), (8, 1, 2.0), (4, 3, None), (4, 3, 2.0)], 3))
def test_tilings_and_soft_cap(block_q, pages_per_block, soft_cap):
    g = GEOMETRIES[0]
    q, kv_pages, md = _inputs(g, "mixed_mid_page_chunks", seed=1)
    q = q * 4  # large logits so the cap matters
    common = dict(sm_scale=SM_SCALE, sliding_window=0)
    want = np.asarray(reference(q, kv_pages, 0, md, soft_cap=soft_cap, **common))
    got = np.asarray(_kernel(block_q, pages_per_block)(q, kv_pages, 0, md, soft_cap=soft_cap,
                                                         **common))
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)
    if soft_cap is not None:
        uncapped = np.asarray(reference(q, kv_pages, 0, md, **common))
        assert np.abs(uncapped - want).max() > 1e-2


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_nan_in_free_and_null_pages_changes_nothing(backend):
    # NOTE: the XLA path under jit, as the model calls it (op by op it compiled ~70
    # programs); the Pallas kernel is jitted itself: the program of
    # test_kernel_matches_reference for this geometry.
    g = GEOMETRIES[3]
    fn = functools.partial(ragged_paged_attention, backend=backend)
    if backend == "xla":
        fn = jax.jit(fn, static_argnames=("sm_scale",))
    outs = []
    for poison in (np.nan, 0.0, 1e4):
        q, kv_pages, md = _inputs(g, "mixed_mid_page_chunks", seed=2, poison=poison)
        outs.append(np.asarray(fn(q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=3)))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_query_blocks_never_mix_requests():
    cu = np.array([0, 3, 3, 20, 21], np.int32)
    blk_seq, blk_start, blk_len = map(np.asarray, query_blocks(cu, 24, 8))
    used = blk_len > 0
    assert list(blk_seq[used]) == [0, 2, 2, 2, 3]
    assert list(blk_start[used]) == [0, 3, 11, 19, 20]
    assert list(blk_len[used]) == [3, 8, 8, 1, 1]
    assert (blk_seq[~used] == 4).all()


def test_bad_shapes_raise():
    g = GEOMETRIES[1]
    q, kv_pages, md = _inputs(g, "full")
    with pytest.raises(ValueError, match=r"num_q_heads 3 .* not a multiple of num_kv_heads 2"):
        reference(q[:, :3], kv_pages, 0, md, sm_scale=1.0)
    with pytest.raises(ValueError, match=r"head_dim of q \(32, 4, 32\)"):
        _kernel(16, 2)(q[:, :, :32], kv_pages, 0, md, sm_scale=1.0)
    with pytest.raises(ValueError, match=r"kv_pages must be .* got shape \(2, 2, 2, 48, 16\)"):
        reference(q, kv_pages[..., 0], 0, md, sm_scale=1.0)
    bad = AttentionMetadata(md.slot_mapping, md.block_tables, md.kv_lens, md.cu_q_lens[:-1])
    with pytest.raises(ValueError, match=r"cu_q_lens \(4,\) must be \[num_seqs \+ 1 = 5\]"):
        _kernel(16, 2)(q, kv_pages, 0, bad, sm_scale=1.0)
    bad = AttentionMetadata(md.slot_mapping, md.block_tables[:2], md.kv_lens, md.cu_q_lens)
    with pytest.raises(ValueError, match=r"block_tables \(2, 8\) must be \[num_seqs=4"):
        reference(q, kv_pages, 0, bad, sm_scale=1.0)
    # The Pallas kernels read pages of q's dtype; the reference (and the XLA path) widens
    # any float pool, but not an integer one without scales.
    with pytest.raises(ValueError, match="q dtype bfloat16 differs from kv_pages dtype float32"):
        _kernel(16, 2)(q.astype("bfloat16"), kv_pages, 0, md, sm_scale=1.0)
    with pytest.raises(ValueError, match="q dtype float32 differs from kv_pages dtype int32"):
        reference(q, kv_pages.astype("int32"), 0, md, sm_scale=1.0)

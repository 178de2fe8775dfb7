"""Paged decode attention: the split-K Pallas kernel (interpret mode) against the reference."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention_kernel
from pallas_kernels.paged_decode_attention.reference import paged_decode_attention_reference
from tests.kernels.cases import Geometry, make_metadata, make_pool, slow_except, tolerance

GEOMETRIES = [
    Geometry(8, 2, 1, 64, num_seqs=6, num_tokens=6),
    Geometry(16, 2, 4, 128, num_seqs=6, num_tokens=6),
    Geometry(32, 3, 3, 64, "bfloat16", num_seqs=6, num_tokens=6, width=4),
    Geometry(16, 1, 8, 64, "bfloat16", num_seqs=6, num_tokens=6),
]
# Context lengths of 6 requests: one page, mid-page ends, a full table, a padded request.
KV_LENS = [1, 7, 33, 100, 0, 128]
SM_SCALE = 0.125

reference = jax.jit(paged_decode_attention_reference,
                    static_argnames=("sm_scale", "soft_cap"))


def _inputs(g: Geometry, seed=0, poison=np.nan):
    rng = np.random.default_rng(seed)
    kv_lens = [min(k, g.width * g.page_size) for k in KV_LENS]
    kv_pages, tables = make_pool(g, kv_lens, rng, poison)
    q = rng.standard_normal((g.num_seqs, g.num_q_heads, g.head_dim)).astype(g.dtype)
    return q, kv_pages, tables, np.asarray(kv_lens, np.int32)


@functools.cache
def _kernel(pages_per_block: int, num_splits: int):
    return functools.partial(paged_decode_attention_kernel, pages_per_block=pages_per_block,
                             num_splits=num_splits, interpret=True)


# NOTE: one compile per (geometry, tiling); the window is data. The default tier runs GQA 1
# in float32 split 3 ways (the last split past the table: empty) and a padded group (3 query
# heads per KV head: 4 rows) in bfloat16 unsplit; the other pairings in the slow tier.
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("g,pages_per_block,num_splits", slow_except(
    [(g, *tiles) for g in GEOMETRIES for tiles in [(1, 1), (2, 3)]], 1, 4), ids=str)
def test_kernel_matches_reference(g, pages_per_block, num_splits, window):
    q, kv_pages, tables, kv_lens = _inputs(g)
    want = np.asarray(reference(q, kv_pages, 1, tables, kv_lens, sm_scale=SM_SCALE,
                                sliding_window=window), np.float32)
    got = np.asarray(_kernel(pages_per_block, num_splits)(
        q, kv_pages, 1, tables, kv_lens, sm_scale=SM_SCALE, sliding_window=window), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)
    assert not got[KV_LENS.index(0)].any(), "a padded request must produce zeros"


def test_soft_cap():
    g = GEOMETRIES[0]
    q, kv_pages, tables, kv_lens = _inputs(g, seed=1)
    q = q * 4
    want = np.asarray(reference(q, kv_pages, 0, tables, kv_lens, sm_scale=SM_SCALE,
                                soft_cap=2.0))
    got = np.asarray(_kernel(2, 2)(q, kv_pages, 0, tables, kv_lens, sm_scale=SM_SCALE,
                                   soft_cap=2.0))
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)
    uncapped = np.asarray(reference(q, kv_pages, 0, tables, kv_lens, sm_scale=SM_SCALE,
                                    sliding_window=0))  # test_kernel_matches_reference's
    assert np.abs(uncapped - want).max() > 1e-2


@pytest.mark.parametrize("backend", ["pallas"])
def test_decode_path_equals_ragged_path(backend):
    """`decode_only` metadata routes to the decode kernel; the result must not change.

    NOTE: Pallas only: the XLA path has no decode program and reads `cu_q_lens` as usual.
    The geometry of test_nan_in_free_and_null_pages_changes_nothing: one decode program.
    """
    g = GEOMETRIES[0]
    q, kv_pages, tables, kv_lens = _inputs(g, seed=3)
    q_lens = [1 if k else 0 for k in kv_lens]
    ragged_md = make_metadata(g, q_lens, list(kv_lens), tables)
    decode_md = make_metadata(g, q_lens, list(kv_lens), tables, decode_only=True)
    # Ragged packing skips the padded request; decode packing keeps token i for request i.
    rows = np.cumsum(q_lens) - 1
    ragged = np.asarray(ragged_paged_attention(q, kv_pages, 1, ragged_md, sm_scale=SM_SCALE,
                                               backend=backend))
    decode = np.asarray(ragged_paged_attention(q[rows], kv_pages, 1, decode_md,
                                               sm_scale=SM_SCALE, backend=backend))
    live = np.asarray(kv_lens) > 0
    np.testing.assert_allclose(decode[live], ragged[rows][live], atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_nan_in_free_and_null_pages_changes_nothing(backend):
    # NOTE: the XLA path under jit, as the model calls it (op by op it compiled ~70
    # programs); the Pallas kernels are jitted themselves.
    g = GEOMETRIES[0]
    fn = functools.partial(ragged_paged_attention, backend=backend)
    if backend == "xla":
        fn = jax.jit(fn, static_argnames=("sm_scale",))
    outs = []
    for poison in (np.nan, 0.0):
        q, kv_pages, tables, kv_lens = _inputs(g, seed=2, poison=poison)
        md = make_metadata(g, [1 if k else 0 for k in kv_lens], list(kv_lens), tables,
                           decode_only=True)
        outs.append(np.asarray(fn(q, kv_pages, 0, md, sm_scale=SM_SCALE, sliding_window=4)))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_bad_shapes_raise():
    g = GEOMETRIES[1]
    q, kv_pages, tables, kv_lens = _inputs(g)
    with pytest.raises(ValueError, match=r"q \(6, 8, 32\) does not fit kv_pages"):
        reference(q[..., :32], kv_pages, 0, tables, kv_lens, sm_scale=1.0)
    with pytest.raises(ValueError, match=r"block_tables \(5, 8\) and kv_lens \(6,\)"):
        _kernel(1, 1)(q, kv_pages, 0, tables[:5], kv_lens, sm_scale=1.0)
    with pytest.raises(ValueError, match=r"q must be \[num_seqs, num_q_heads, head_dim\]"):
        reference(q[0], kv_pages, 0, tables, kv_lens, sm_scale=1.0)
    md = make_metadata(g, [1] * 6, [1] * 6, tables, decode_only=True)
    with pytest.raises(ValueError, match=r"decode_only needs one token per request"):
        ragged_paged_attention(q[:3], kv_pages, 0, md, sm_scale=1.0, backend="pallas")

"""Batch-invariant building blocks (`pallas_kernels.invariant`) against the jnp reference and
plain XLA, and bit-for-bit the same for a row wherever it sits and whatever shares its step
(the "xla" and "cpu" backends' attention in batch-invariant mode through `ops`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_ffi
from pallas_kernels.invariant import fixed_sum, invariant_attention, row_tiled
from pallas_kernels.ops import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels.cases import Geometry, make_metadata, make_pool, tolerance
from tests.kernels.test_ragged_xla import LAYOUTS

SM_SCALE = 0.25
G = Geometry(page_size=16, num_kv_heads=3, group=3, head_dim=16)
reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))


@functools.cache
def invariant(block_kv: int, token_tile: int):
    return jax.jit(functools.partial(invariant_attention, block_kv=block_kv,
                                     token_tile=token_tile),
                   static_argnames=("sm_scale", "soft_cap"))


@pytest.mark.parametrize("window,soft_cap", [(0, None), (5, 2.0)])
@pytest.mark.parametrize("layout", ["mixed_mid_page_chunks", "decodes_first_then_chunk",
                                    "second_chunk_of_a_long_prompt"])
def test_attention_matches_reference(layout, window, soft_cap):
    """Small blocks and tiles (several of each), NaN in every page no request owns."""
    rng = np.random.default_rng(0)
    q_lens, kv_lens = LAYOUTS[layout]
    kv_pages, tables = make_pool(G, kv_lens, rng)
    md = make_metadata(G, q_lens, kv_lens, tables)
    q = rng.standard_normal((G.num_tokens, G.num_q_heads, G.head_dim)).astype(np.float32)
    want = np.asarray(reference(q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=window,
                                soft_cap=soft_cap))
    got = np.asarray(invariant(16, 4)(q, kv_pages, 1, md, sm_scale=SM_SCALE,
                                      sliding_window=window, soft_cap=soft_cap))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance("float32"), rtol=0)
    assert not got[int(np.asarray(md.cu_q_lens)[-1]):].any(), "padded tokens give zeros"


def _pool_and_tables(rng, num_pages=40):
    """A pool with three requests' pages: A 1-8, B 9-16, C 17-24 (NaN elsewhere)."""
    pool = np.full((2, 2, G.num_kv_heads, num_pages, G.page_size, G.head_dim), np.nan,
                   np.float32)
    pool[:, :, :, 1:25] = rng.standard_normal(pool[:, :, :, 1:25].shape)
    return jnp.asarray(pool), {"A": np.arange(1, 9), "B": np.arange(9, 17),
                               "C": np.arange(17, 25)}


def _step(qs, tables, reqs, num_tokens, num_rows):
    """Queries and metadata of a step of `reqs`: (request, first position, new tokens)."""
    from pallas_kernels import AttentionMetadata

    q = np.zeros((num_tokens, G.num_q_heads, G.head_dim), np.float32)
    bt = np.zeros((num_rows, 8), np.int32)
    kv, cu, t = np.zeros(num_rows, np.int32), np.zeros(num_rows + 1, np.int32), 0
    for i, (name, start, n) in enumerate(reqs):
        q[t:t + n] = qs[name][start:start + n]
        bt[i], kv[i], t = tables[name], start + n, t + n
        cu[i + 1:] = t
    md = AttentionMetadata(jnp.zeros(num_tokens, jnp.int32), jnp.asarray(bt), jnp.asarray(kv),
                           jnp.asarray(cu))
    return jnp.asarray(q), md


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_ffi.available(), reason="the cpu backend's kernel does not build here"))])
def test_a_token_is_the_same_in_any_step(backend):
    """Token 50 of request A: decoded alone (bucket 4), among other decodes, inside prefill
    chunks of several lengths beside other requests, in a big bucket: the same bits."""
    rng = np.random.default_rng(1)
    pool, tables = _pool_and_tables(rng)
    qs = {k: rng.standard_normal((128, G.num_q_heads, G.head_dim)).astype(np.float32)
          for k in tables}
    f = jax.jit(functools.partial(ragged_paged_attention, sm_scale=SM_SCALE, backend=backend,
                                  batch_invariant=True))
    steps = {  # (reqs, num_tokens, num_rows, A's token index of position 50)
        "alone": ([("A", 50, 1)], 4, 4, 0),
        "among decodes": ([("B", 10, 1), ("A", 50, 1), ("C", 70, 1)], 16, 16, 1),
        "prefill 0-63": ([("A", 0, 64)], 64, 16, 50),
        "chunk 48-63 after B": ([("B", 0, 20), ("A", 48, 16)], 64, 16, 22),
        "bucket 256": ([("A", 40, 60), ("B", 0, 100)], 256, 16, 10),
    }
    out = {}
    for k, (reqs, num_tokens, num_rows, i) in steps.items():
        q, md = _step(qs, tables, reqs, num_tokens, num_rows)
        out[k] = np.asarray(f(q, pool, 1, md))[i]
    assert np.isfinite(out["alone"]).all()
    for k, got in out.items():
        assert np.array_equal(got, out["alone"]), f"{backend}: {k} differs from alone"


def test_row_tiled_is_the_same_for_any_row_count():
    """A row of `x @ w` in row tiles: the same bits among 1 to 256 rows, at any position
    (plain XLA's dot is not: the case the tiles exist for)."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((72, 216)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((256, 72)), jnp.float32)
    tiled = jax.jit(lambda x: row_tiled(lambda t: t @ w, x, 16))
    want = np.asarray(tiled(x[:1]))[0]
    np.testing.assert_allclose(want, np.asarray(x[0] @ w), rtol=1e-5, atol=1e-5)
    for rows in (2, 5, 16, 33, 256):
        for pos in {0, min(3, rows - 1)}:
            got = np.asarray(tiled(x[:rows].at[pos].set(x[0])))[pos]
            assert np.array_equal(got, want), (rows, pos)
    assert np.array_equal(np.asarray(row_tiled(lambda t: t @ w, x[:5], 0)),
                          np.asarray(x[:5] @ w))


def test_fixed_sum():
    """The halving tree: close to a float64 sum; widths that are not powers of two."""
    rng = np.random.default_rng(3)
    for n in (1, 7, 72, 576):
        x = rng.standard_normal((3, n)).astype(np.float32)
        got = np.asarray(fixed_sum(jnp.asarray(x)))
        assert got.shape == (3, 1)
        np.testing.assert_allclose(got[:, 0], x.astype(np.float64).sum(-1), rtol=1e-5,
                                   atol=1e-5)


def test_pallas_has_no_invariant_mode():
    rng = np.random.default_rng(4)
    pool, tables = _pool_and_tables(rng)
    q, md = _step({"A": np.zeros((8, 9, 16), np.float32)}, tables, [("A", 0, 4)], 4, 4)
    with pytest.raises(ValueError, match="not built for the 'pallas' backend"):
        ragged_paged_attention(q, pool, 1, md, sm_scale=SM_SCALE, backend="pallas",
                               batch_invariant=True)

"""Attention through one KV cache group's block tables (a hybrid KV cache, `models.kv_groups`).

A sliding group's pages that fell wholly out of every query's window are given back while
the request runs: its table then reads 0 (the null page) there, and the page itself may hold
anything (another request's KV, NaN). Every attention path must give exactly what the
reference gives on the original table and pool. And grouped metadata (a group axis on the
slot mapping and block tables) hands each layer its group's plain 2-D view.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionMetadata, cpu_ffi, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels.cases import Geometry, make_metadata, make_pool, tolerance

SM_SCALE = 0.125
WINDOW = 10
# Geometry(8, 2, 1, 64) as test_ragged_paged_attention's first (a shared compile).
G = Geometry(8, 2, 1, 64)
# Decode rows with long contexts, a chunk after a context (its tile reads given-back pages
# before its first query's window), a fresh prompt: 23 of 32 token slots.
Q_LENS, KV_LENS = [1, 1, 9, 12], [40, 23, 50, 12]
# Decode-only steps (one token per request: the Pallas decode kernel).
G_DECODE = Geometry(8, 2, 1, 64, num_seqs=4, num_tokens=4)
DECODE_KV_LENS = [40, 23, 50, 9]

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))


def inputs(g: Geometry, q_lens, kv_lens, decode_only=False, seed=0):
    rng = np.random.default_rng(seed)
    kv_pages, tables = make_pool(g, kv_lens, rng)  # NaN in free and null pages
    md = make_metadata(g, q_lens, kv_lens, tables, decode_only=decode_only)
    q = jnp.asarray(rng.standard_normal((len(md.slot_mapping), g.num_q_heads, g.head_dim)),
                    g.dtype)
    return q, kv_pages, md


def given_back(md: AttentionMetadata, kv_pages, window: int):
    """(md, pool) after a sliding group gave back each request's pages that lie wholly
    before its first query's window: their table entries 0, the pages themselves NaN."""
    tables = np.asarray(md.block_tables).copy()  # i32[rows, width]
    pool = np.asarray(kv_pages, np.float32).copy()
    page_size = pool.shape[4]
    q_lens = np.diff(np.asarray(md.cu_q_lens))
    first = np.asarray(md.kv_lens) - q_lens  # i32[rows] position of each first query
    freed = 0
    for r, pos in enumerate(first):
        for p in range(max(0, pos - window + 1) // page_size):
            pool[:, :, :, tables[r, p]] = np.nan
            tables[r, p] = 0
            freed += 1
    assert freed >= 4, "the case must give pages back"
    return (dataclasses.replace(md, block_tables=jnp.asarray(tables)),
            jnp.asarray(pool, kv_pages.dtype))


@functools.cache
def _op(backend: str):
    return jax.jit(functools.partial(ragged_paged_attention, backend=backend),
                   static_argnames=("sm_scale", "soft_cap"))


def _tpu(q, kv_pages, layer, md, **common):
    return ragged_paged_attention_tpu(q, kv_pages, layer, md, block_q=8, pages_per_block=2,
                                      interpret=True, **common)


PATHS = {  # name: (attention function, decode-only step)
    "reference": (reference, False),
    "xla": (_op("xla"), False),
    "cpu": (_op("cpu"), False),
    "pallas": (_op("pallas"), False),  # the ragged kernel, blocks of 4 pages
    "pallas_decode": (_op("pallas"), True),  # the paged decode kernel
    "tpu": (_tpu, False),  # the Mosaic kernel in the TPU interpreter
}


@pytest.mark.parametrize("path", [
    "reference", "xla",
    pytest.param("cpu", marks=pytest.mark.skipif(not cpu_ffi.available(),
                                                 reason="no CPU decode kernel here")),
    "pallas", "pallas_decode", "tpu"])
def test_given_back_pages_before_the_window_change_nothing(path):
    fn, decode_only = PATHS[path]
    g, q_lens, kv_lens = ((G_DECODE, [1] * 4, DECODE_KV_LENS) if decode_only
                          else (G, Q_LENS, KV_LENS))
    q, kv_pages, md = inputs(g, q_lens, kv_lens, decode_only)
    common = dict(sm_scale=SM_SCALE, sliding_window=WINDOW, soft_cap=None)
    want = np.asarray(reference(q, kv_pages, 1, md, **common), np.float32)
    md_null, pool_null = given_back(md, kv_pages, WINDOW)
    got = np.asarray(fn(q, pool_null, 1, md_null, **common), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)


def grouped(md: AttentionMetadata, md_other: AttentionMetadata) -> AttentionMetadata:
    """Metadata of two groups: `md`'s tables and slots as group 0, `md_other`'s as group 1."""
    return dataclasses.replace(
        md, slot_mapping=jnp.stack([md.slot_mapping, md_other.slot_mapping]),
        block_tables=jnp.stack([md.block_tables, md_other.block_tables]))


def test_for_group_picks_a_groups_view_in_the_layer_loop():
    q, kv_pages, md = inputs(G, Q_LENS, KV_LENS)
    md_null, _ = given_back(md, kv_pages, WINDOW)
    two = grouped(md, md_null)
    assert (two.num_groups, md.num_groups) == (2, 1)
    assert md.for_group(1) is md  # one group: the plain arrays as they are

    @jax.jit
    def per_group(md, group):  # the group (and slot) traced, as in the layer scan
        view = md.for_group(group)
        return view.slot_mapping, view.block_tables, ragged_paged_attention(
            q, kv_pages, group, view, sm_scale=SM_SCALE, sliding_window=WINDOW)

    for group, want_md in enumerate([md, md_null]):
        slots, tables, out = per_group(two, jnp.int32(group))
        np.testing.assert_array_equal(slots, want_md.slot_mapping)
        np.testing.assert_array_equal(tables, want_md.block_tables)
        want = reference(q, kv_pages, group, want_md, sm_scale=SM_SCALE,
                         sliding_window=WINDOW)
        np.testing.assert_allclose(out, want, atol=tolerance(G.dtype), rtol=0)


def test_grouped_metadata_given_to_a_kernel_is_an_error():
    q, kv_pages, md = inputs(G, Q_LENS, KV_LENS)
    with pytest.raises(ValueError, match=r"block_tables \(2, 4, 8\) must be \[num_seqs=4"):
        ragged_paged_attention(q, kv_pages, 0, grouped(md, md), sm_scale=SM_SCALE,
                               backend="xla")

"""Chunked local attention (Llama 4's `attention_chunk_size`) in the attention paths: the jnp
reference against NumPy (a query at p sees keys floor(p / C) * C .. p), then the XLA path and
the "cpu" backend's C++ rows (a chunk of whole pages: tables shifted to the chunk's first
page; otherwise the XLA parts) against the reference on one ragged step whose pages before
each request's chunk went back (null entries: NaN pages), and the paths that refuse it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionOps, ragged_paged_attention
from pallas_kernels.cpu_ffi import op
from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    token_positions,
)
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from tests.kernels.cases import Geometry, make_metadata, make_pool

G = Geometry(2, 2, 2, 16, num_tokens=12, num_seqs=4, width=8, num_pages=24)
# Two decodes (positions 8 and 3), a chunk of 7 after 6 keys, an empty request.
Q_LENS, KV_LENS = [1, 1, 7, 0], [9, 4, 13, 0]
SCALE = 0.3
ATOL = 2e-5

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale",))
xla_path = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=SCALE))
needs_kernel = pytest.mark.skipif(not op.available(),
                                  reason=f"no CPU decode kernel here: {op.unavailable_reason()}")


def step_for(chunk: int):
    """(q, pool, md): the step, each request's pages wholly before its first query's chunk
    given back (null entries; page 0 and unowned pages hold NaN)."""
    rng = np.random.default_rng(65)
    pool, tables = make_pool(G, KV_LENS, rng)
    tables = np.array(tables)
    for i, (q, k) in enumerate(zip(Q_LENS, KV_LENS, strict=True)):
        first = k - q  # the first query's position
        tables[i, :(first - first % chunk) // G.page_size] = 0
    md = make_metadata(G, Q_LENS, KV_LENS, tables)
    q = jnp.asarray(rng.standard_normal((G.num_tokens, G.num_q_heads, G.head_dim)), G.dtype)
    return q, pool, md


def numpy_chunked(q, pool, md, chunk):
    """Token by token: softmax over keys floor(p / C) * C .. p of the request."""
    q, pool = np.asarray(q, np.float64), np.asarray(pool, np.float64)
    tables = np.asarray(md.block_tables)
    seq_ids, q_pos, valid = (np.asarray(x) for x in token_positions(md, q.shape[0]))
    group = q.shape[1] // pool.shape[2]
    out = np.zeros_like(q)
    for t in np.flatnonzero(valid):
        s, p = seq_ids[t], q_pos[t]
        keys = np.arange(p - p % chunk, p + 1)
        slots = tables[s, keys // G.page_size], keys % G.page_size
        for h in range(q.shape[1]):
            k, v = (pool[1, kv, h // group][slots] for kv in (0, 1))  # [keys, D]
            logits = k @ q[t, h] * SCALE
            probs = np.exp(logits - logits.max())
            out[t, h] = probs / probs.sum() @ v
    return out


# NOTE: a chunk of part pages (the C++ rows hand its tokens to the XLA parts) compiles every
# path again: slow tier.
@pytest.fixture(scope="module", params=[
    pytest.param(4, id="whole_pages"),
    pytest.param(3, id="part_pages", marks=pytest.mark.slow(reason="~4 s of recompiles"))])
def case(request):
    """(chunk, q, pool, md, the reference's output)."""
    chunk = request.param
    q, pool, md = step_for(chunk)
    want = np.asarray(reference(q, pool, 1, md, sm_scale=SCALE, chunk_size=jnp.int32(chunk)))
    return chunk, q, pool, md, want


def test_reference_equals_numpy(case):
    chunk, q, pool, md, want = case
    np.testing.assert_allclose(want, numpy_chunked(q, pool, md, chunk), atol=ATOL)


def test_xla_path_matches_the_reference(case):
    chunk, q, pool, md, want = case
    got = xla_path(q, pool, 1, md, chunk_size=jnp.int32(chunk))
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


@needs_kernel
def test_cpu_backend_matches_the_reference(case):
    # Short contexts: every token is a C++ row when the chunk is whole pages (its table
    # shifted), and goes to the XLA parts otherwise.
    chunk, q, pool, md, want = case
    ops = AttentionOps("cpu")
    got = jax.jit(lambda q, p, md, c: ops.attend(q, p, 1, md, sm_scale=SCALE, chunk_size=c))(
        q, pool, md, jnp.int32(chunk))
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


def test_no_chunk_is_plain_causal_attention():
    q, pool, md = step_for(64)  # a chunk longer than every context: nothing given back
    plain = reference(q, pool, 1, md, sm_scale=SCALE)
    np.testing.assert_array_equal(
        np.asarray(reference(q, pool, 1, md, sm_scale=SCALE, chunk_size=jnp.int32(0))),
        np.asarray(plain))
    np.testing.assert_allclose(
        np.asarray(reference(q, pool, 1, md, sm_scale=SCALE, chunk_size=jnp.int32(64))),
        np.asarray(plain), atol=ATOL)


@pytest.mark.parametrize("kw", [dict(backend="pallas"), dict(batch_invariant=True)],
                         ids=["pallas", "batch_invariant"])
def test_paths_without_chunks_refuse_them(kw):
    q, pool, md = step_for(4)
    with pytest.raises(ValueError, match="chunk_size"):
        ragged_paged_attention(q, pool, 1, md, sm_scale=SCALE, chunk_size=4, **kw)

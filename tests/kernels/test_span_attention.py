"""Bidirectional spans (`AttentionMetadata.q_span_end`: Gemma 3's image tokens see their whole
image) in the attention paths: the jnp reference against NumPy (a query at p in a span ending
at e sees keys 0 .. max(p, e - 1)), then every path against the reference on one ragged step:
a decode, a request whose image lies inside the step (crossing the kernels' query blocks), one
whose image began in an earlier step (its first keys in the cache), an empty request. The XLA
path, the "cpu" backend (rows with spans keep off the C++ rows), the Pallas ragged kernel in
the interpreter, batch-invariant mode, and with a sliding window."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionOps
from pallas_kernels.cpu_ffi import op
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention_kernel
from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    token_positions,
)
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from tests.kernels.cases import Geometry, make_metadata, make_pool

G = Geometry(2, 2, 2, 16, num_tokens=24, num_seqs=4, width=10, num_pages=32)
# A decode at 8; 12 new tokens after 3 (positions 3-14, an image at 5-11); 5 new tokens after
# 8 (positions 8-12, an image at 6-10 whose first two tokens are cached); an empty request.
Q_LENS, KV_LENS = [1, 12, 5, 0], [9, 15, 13, 0]
SPANS = {1: (5, 12), 2: (6, 11)}  # request -> [start, end) of its image
SCALE = 0.3
ATOL = 2e-5

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale",))
needs_kernel = pytest.mark.skipif(not op.available(),
                                  reason=f"no CPU decode kernel here: {op.unavailable_reason()}")


@functools.cache
def step():
    """(q, pool, md): the step with each token's span end (0 outside the images)."""
    rng = np.random.default_rng(67)
    pool, tables = make_pool(G, KV_LENS, rng)
    md = make_metadata(G, Q_LENS, KV_LENS, tables)
    seq_ids, q_pos, valid = (np.asarray(x) for x in token_positions(md, G.num_tokens))
    ends = np.zeros(G.num_tokens, np.int32)
    for t in range(G.num_tokens):
        start, end = SPANS.get(int(seq_ids[t]), (0, 0))
        if valid[t] and start <= q_pos[t] < end:
            ends[t] = end
    md = dataclasses.replace(md, q_span_end=jnp.asarray(ends))
    q = jnp.asarray(rng.standard_normal((G.num_tokens, G.num_q_heads, G.head_dim)), G.dtype)
    return q, pool, md


def numpy_spans(q, pool, md, window=0):
    """Token by token: softmax over keys 0 .. max(p, e - 1) (and the window before p)."""
    q, pool = np.asarray(q, np.float64), np.asarray(pool, np.float64)
    tables, ends = np.asarray(md.block_tables), np.asarray(md.q_span_end)
    seq_ids, q_pos, valid = (np.asarray(x) for x in token_positions(md, q.shape[0]))
    group = q.shape[1] // pool.shape[2]
    out = np.zeros(q.shape)
    for t in np.flatnonzero(valid):
        p = q_pos[t]
        keys = np.arange(max(0, p - window + 1) if window else 0, max(p, ends[t] - 1) + 1)
        pages = tables[seq_ids[t], keys // G.page_size]
        k = pool[1, 0][:, pages, keys % G.page_size]  # [Hkv, n, D]
        v = pool[1, 1][:, pages, keys % G.page_size]
        for h in range(q.shape[1]):
            logits = k[h // group] @ q[t, h] * SCALE
            w = np.exp(logits - logits.max())
            out[t, h] = (w / w.sum()) @ v[h // group]
    return out


@pytest.fixture(scope="module")
def want():
    q, pool, md = step()
    return np.asarray(reference(q, pool, 1, md, sm_scale=SCALE))


def test_reference_equals_numpy(want):
    q, pool, md = step()
    np.testing.assert_allclose(want, numpy_spans(q, pool, md), atol=ATOL)
    # the spans matter: causal attention differs on the images' early tokens only
    causal = np.asarray(reference(q, pool, 1, dataclasses.replace(md, q_span_end=None),
                                  sm_scale=SCALE))
    differs = np.abs(causal - want).max(axis=(1, 2)) > 1e-3
    ends = np.asarray(md.q_span_end)
    _, q_pos, _ = token_positions(md, G.num_tokens)
    assert np.array_equal(differs, ends - 1 > np.asarray(q_pos))


def test_xla_path_matches_the_reference(want):
    q, pool, md = step()
    got = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=SCALE))(q, pool, 1, md)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=needs_kernel), "pallas"])
@pytest.mark.parametrize("invariant", [False, True], ids=["packed", "invariant"])
def test_every_backend_matches_the_reference(want, backend, invariant):
    if backend == "pallas" and invariant:
        pytest.skip("batch-invariant mode is not built for the pallas backend")
    q, pool, md = step()
    ops = AttentionOps(backend, batch_invariant=invariant)
    got = jax.jit(lambda q, p, md: ops.attend(q, p, 1, md, sm_scale=SCALE))(q, pool, md)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


def test_ragged_kernel_blocks_cross_the_image(want):
    # Blocks of 4 queries: the in-step image (tokens 1-12's positions 5-11) spans three blocks,
    # and its first block must visit the key blocks up to the image's end.
    q, pool, md = step()
    got = ragged_paged_attention_kernel(q, pool, 1, md, sm_scale=SCALE, block_q=4,
                                        pages_per_block=1, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


def test_a_sliding_window_keeps_its_lower_bound():
    q, pool, md = step()
    got = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=SCALE))(
        q, pool, 1, md, sliding_window=jnp.int32(8))
    np.testing.assert_allclose(np.asarray(got), numpy_spans(q, pool, md, window=8), atol=ATOL)
    ref = reference(q, pool, 1, md, sm_scale=SCALE, sliding_window=jnp.int32(8))
    np.testing.assert_allclose(np.asarray(ref), np.asarray(got), atol=ATOL)


def test_bad_span_shapes_are_named():
    q, pool, md = step()
    with pytest.raises(ValueError, match="q_span_end"):
        reference(q, pool, 1, dataclasses.replace(md, q_span_end=md.q_span_end[:5]),
                  sm_scale=SCALE)

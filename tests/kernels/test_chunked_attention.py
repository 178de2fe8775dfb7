"""Chunked local attention (Llama 4's `attention_chunk_size`) in the attention paths: the jnp
reference against NumPy (a query at p sees keys floor(p / C) * C .. p), then every path against
the reference on one ragged step whose pages before each request's chunk went back (null
entries: NaN pages): the XLA path, the "cpu" backend's C++ rows (a chunk of whole pages: tables
shifted to the chunk's first page; otherwise the XLA parts), the Pallas kernels in the
interpreter (ragged, decode, TPU) and batch-invariant mode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionOps
from pallas_kernels.cpu_ffi import op
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention_kernel
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention_kernel
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
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


def step_for(chunk: int, q_lens=Q_LENS, kv_lens=KV_LENS, decode_only=False):
    """(q, pool, md): the step, each request's pages wholly before its first query's chunk
    given back (null entries; page 0 and unowned pages hold NaN)."""
    rng = np.random.default_rng(65)
    pool, tables = make_pool(G, kv_lens, rng)
    tables = np.array(tables)
    for i, (q, k) in enumerate(zip(q_lens, kv_lens, strict=True)):
        first = k - q  # the first query's position
        tables[i, :(first - first % chunk) // G.page_size] = 0
    md = make_metadata(G, q_lens, kv_lens, tables, decode_only)
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


def test_ragged_kernel_matches_the_reference(case):
    # Blocks of 4 queries and of one page of keys: the 7-token request's blocks (positions
    # 6-9, 10-12) each hold a chunk boundary, and their first key blocks skip given-back pages.
    chunk, q, pool, md, want = case
    got = ragged_paged_attention_kernel(q, pool, 1, md, sm_scale=SCALE, block_q=4,
                                        pages_per_block=1, interpret=True,
                                        chunk_size=jnp.int32(chunk))
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


@pytest.mark.parametrize("chunk", [4, 3])
def test_decode_kernel_matches_the_reference(chunk):
    # Decodes at positions 8, 3, 12 and 0, two splits of one page (2 keys) per block: chunk 4
    # starts on a block (the first split of the request at 12 sees nothing), chunk 3 inside
    # one (position 3: key 2 of its first block is masked).
    q_lens, kv_lens = [1, 1, 1, 1], [9, 4, 13, 1]
    q, pool, md = step_for(chunk, q_lens, kv_lens, decode_only=True)
    q = q[:len(q_lens)]
    want = reference(q, pool, 1, md, sm_scale=SCALE, chunk_size=jnp.int32(chunk))
    got = paged_decode_attention_kernel(q, pool, 1, md.block_tables, md.kv_lens, sm_scale=SCALE,
                                        pages_per_block=1, num_splits=2, interpret=True,
                                        chunk_size=jnp.int32(chunk))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL)


def test_tpu_kernel_matches_the_reference_in_interpreter(case):
    chunk, q, pool, md, want = case
    got = ragged_paged_attention_tpu(q, pool, 1, md, sm_scale=SCALE, block_q=8,
                                     pages_per_block=1, interpret=True,
                                     chunk_size=jnp.int32(chunk))
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=needs_kernel)])
def test_batch_invariant_mode_matches_the_reference(case, backend):
    # On "cpu" a chunk keeps the tokens off the C++ rows (invariant_attention in XLA).
    chunk, q, pool, md, want = case
    ops = AttentionOps(backend, batch_invariant=True)
    got = jax.jit(lambda q, p, md, c: ops.attend(q, p, 1, md, sm_scale=SCALE, chunk_size=c))(
        q, pool, md, jnp.int32(chunk))
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


def test_pallas_backend_serves_chunks():
    # The dispatch: a mixed step to the ragged kernel, a decode-only step to the decode kernel.
    ops = AttentionOps("pallas")
    attend = jax.jit(lambda q, p, md, c: ops.attend(q, p, 1, md, sm_scale=SCALE, chunk_size=c))
    for q_lens, kv_lens, decode_only in [(Q_LENS, KV_LENS, False),
                                         ([1, 1, 1, 1], [9, 4, 13, 1], True)]:
        q, pool, md = step_for(4, q_lens, kv_lens, decode_only)
        q = q[:md.slot_mapping.shape[0]]
        want = reference(q, pool, 1, md, sm_scale=SCALE, chunk_size=jnp.int32(4))
        np.testing.assert_allclose(np.asarray(attend(q, pool, md, jnp.int32(4))),
                                   np.asarray(want), atol=ATOL)

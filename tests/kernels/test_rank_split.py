"""Data-parallel attention's per-rank kernels (`pallas_kernels.rank_split`) on 2 and 4 CPU
devices: a rank-blocked step's KV writes and attention (GQA pages, MLA latents absorbed and
expanded) equal the jnp references run rank by rank on the whole pool with global ids; the
pool stays split by pages and no rank touches another's pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from pallas_kernels import AttentionMetadata, AttentionOps
from pallas_kernels.kv_write.reference import write_kv_reference
from pallas_kernels.mla.reference import (
    mla_attention_reference,
    mla_expanded_reference,
    write_latent_reference,
)
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.rank_split import AttentionRanks

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (CPU) devices")

PAGE, PAGES_PER_RANK, TOKENS, ROWS, WIDTH = 4, 8, 16, 4, 6
HKV, GROUP, D = 2, 2, 16  # GQA pool: KV heads, query heads per KV head, head_dim
R, DR, H, DN, DV = 16, 8, 4, 8, 12  # MLA: latent rank, rope dims, heads, nope, value dims
# Per rank (query length, context length) of each request: ranks differ in load, rank 1 of
# the 4 has nothing (all padding), decodes and chunks after a context mixed.
LOADS = [[(1, 6), (5, 5), (3, 11)], [], [(2, 9), (1, 1)], [(7, 7), (1, 17)]]


def _ranks(n: int) -> AttentionRanks:
    grid = np.asarray(jax.devices()[:n]).reshape(n, 1, 1)
    return AttentionRanks(Mesh(grid, ("expert", "kv", "rep")), "expert")


def _step(n: int, rng):
    """(rank-blocked AttentionMetadata, [(local md with global page ids, token slice)] per
    rank): each rank's requests own shuffled pages of its own range, never its first."""
    loads = [LOADS[0], LOADS[2]] if n == 2 else LOADS
    slots, tables, kv_lens, cu, parts = [], [], [], [], []
    for r, load in enumerate(loads):
        free = list(rng.permutation(np.arange(1, PAGES_PER_RANK)) + r * PAGES_PER_RANK)
        s = np.zeros(TOKENS, np.int32)  # padding: global slot 0
        t = np.zeros((ROWS, WIDTH), np.int32)
        k = np.zeros(ROWS, np.int32)
        c = np.zeros(ROWS + 1, np.int32)
        for i, (q, kv) in enumerate(load):
            pages = [free.pop() for _ in range(-(-kv // PAGE))]
            t[i, :len(pages)] = pages
            pos = np.arange(kv - q, kv)
            s[c[i]:c[i] + q] = t[i, pos // PAGE] * PAGE + pos % PAGE
            k[i], c[i + 1] = kv, c[i] + q
        c[len(load) + 1:] = c[len(load)]
        slots.append(s), tables.append(t), kv_lens.append(k), cu.append(c)
        parts.append((AttentionMetadata(*map(jnp.asarray, (s, t, k, c))),
                       slice(r * TOKENS, (r + 1) * TOKENS)))
    md = AttentionMetadata(*(jnp.asarray(np.concatenate(a)) for a in (slots, tables, kv_lens,
                                                                      cu)), num_ranks=n)
    return md, parts


def _split(ranks: AttentionRanks, pool):
    return jax.device_put(pool, NamedSharding(ranks.mesh, ranks.pool_spec(pool.ndim)))


def _real(pool, n):
    """The pool without each rank's null page (padding lands there; the reference's on 0)."""
    keep = [p for p in range(n * PAGES_PER_RANK) if p % PAGES_PER_RANK]
    return np.asarray(pool)[:, :, :, keep]


@pytest.mark.parametrize("n", [2, 4])
def test_gqa_write_and_attention_per_rank_equal_the_references(n):
    rng = np.random.default_rng(n)
    ranks = _ranks(n)
    md, parts = _step(n, rng)
    shape = (2, 2, HKV, n * PAGES_PER_RANK, PAGE, D)
    pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((n * TOKENS, HKV, D)), jnp.float32) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((n * TOKENS, HKV * GROUP, D)), jnp.float32)
    ops = AttentionOps("xla", ranks=ranks)
    written = jax.jit(ops.write_kv)(_split(ranks, pool), 1, k, v, md.slot_mapping)
    assert written.sharding.spec == ranks.pool_spec()
    want = pool
    for part, toks in parts:
        want = write_kv_reference(want, 1, k[toks], v[toks], part.slot_mapping)
    np.testing.assert_array_equal(_real(written, n), _real(want, n))
    out = jax.jit(lambda q, p, md: ops.attend(q, p, 1, md, sm_scale=0.3))(q, written, md)
    for part, toks in parts:
        ref = ragged_paged_attention_reference(q[toks], want, 1, part, sm_scale=0.3)
        real = int(part.cu_q_lens[-1])
        np.testing.assert_allclose(np.asarray(out[toks])[:real], np.asarray(ref)[:real],
                                   atol=2e-5)


@pytest.mark.parametrize("n", [2, 4])
def test_mla_write_and_both_forms_per_rank_equal_the_references(n):
    rng = np.random.default_rng(10 + n)
    ranks = _ranks(n)
    md, parts = _step(n, rng)
    pool = jnp.asarray(rng.standard_normal((2, 1, 1, n * PAGES_PER_RANK, PAGE, R + DR)),
                       jnp.float32)
    latent = jnp.asarray(rng.standard_normal((n * TOKENS, R + DR)), jnp.float32)
    q_lat, q_pe = (jnp.asarray(rng.standard_normal((n * TOKENS, H, d)), jnp.float32)
                   for d in (R, DR))
    q_nope = jnp.asarray(rng.standard_normal((n * TOKENS, H, DN)), jnp.float32)
    w_uk, w_uv = (jnp.asarray(0.3 * rng.standard_normal((R, H, d)), jnp.float32)
                  for d in (DN, DV))
    ops = AttentionOps("xla", ranks=ranks)
    written = jax.jit(ops.write_latent)(_split(ranks, pool), 0, latent, md.slot_mapping)
    want = pool
    for part, toks in parts:
        want = write_latent_reference(want, 0, latent[toks], part.slot_mapping)
    np.testing.assert_array_equal(_real(written, n), _real(want, n))
    absorbed = jax.jit(lambda *a: ops.mla_attend(*a, sm_scale=0.25))(q_lat, q_pe, written, 0,
                                                                     md)
    expanded = jax.jit(lambda *a: ops.mla_attend_expanded(*a, sm_scale=0.25))(
        q_nope, q_pe, written, 0, md, w_uk, w_uv)
    for part, toks in parts:
        real = int(part.cu_q_lens[-1])
        ref = mla_attention_reference(q_lat[toks], q_pe[toks], want, 0, part, sm_scale=0.25)
        np.testing.assert_allclose(np.asarray(absorbed[toks])[:real],
                                   np.asarray(ref)[:real], atol=2e-5)
        ref = mla_expanded_reference(q_nope[toks], q_pe[toks], want, 0, part, w_uk, w_uv,
                                     sm_scale=0.25)
        np.testing.assert_allclose(np.asarray(expanded[toks])[:real],
                                   np.asarray(ref)[:real], atol=2e-5)

"""Learned attention sinks (gpt-oss) in every attention path: the jnp reference against a
NumPy softmax with the sink as an extra column (transformers' `eager_attention_forward`),
then every path against the reference on one ragged step (decodes, a chunk after its
context, an empty request, padded tokens), the Mosaic and Triton lowerings, data-parallel
ranks, sinks=None unchanged, and bad sinks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionMetadata, AttentionOps, ragged_paged_attention
from pallas_kernels.cpu_ffi import op
from pallas_kernels.invariant import invariant_attention
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention_kernel
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention_kernel
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    token_positions,
)
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from tests.kernels.cases import Geometry, make_metadata, make_pool
from tests.kernels.test_rank_split import _ranks, _split, _step

G = Geometry(4, 2, 2, 16, num_tokens=12, num_seqs=4, width=4, num_pages=16)
Q_LENS, KV_LENS = [1, 1, 5, 0], [7, 3, 9, 0]  # two decodes, a chunk after 4 keys, empty
SCALE, WINDOW, CAP = 0.3, 3, 20.0
ATOL = 2e-5

# NOTE: jitted (scale and cap static, window and sinks traced): run eagerly, its every op
# compiled on its own, the reference cost seconds.
reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))

needs_kernel = pytest.mark.skipif(not op.available(),
                                  reason=f"no CPU decode kernel here: {op.unavailable_reason()}")


@pytest.fixture(scope="module")
def step():
    """(q, pool, md, sinks): NaN in every page no request owns; sinks of both signs, large
    enough to take most of some rows' mass."""
    rng = np.random.default_rng(65)
    pool, tables = make_pool(G, KV_LENS, rng)
    md = make_metadata(G, Q_LENS, KV_LENS, tables)
    q = jnp.asarray(rng.standard_normal((G.num_tokens, G.num_q_heads, G.head_dim)), G.dtype)
    sinks = jnp.asarray([2.5, -1.0, 0.5, 4.0], jnp.float32)
    return q, pool, md, sinks


@pytest.fixture(scope="module")
def want(step):
    """The reference with sinks, a window and a soft cap: what every path must give."""
    q, pool, md, sinks = step
    return np.asarray(reference(q, pool, 1, md, sm_scale=SCALE, sliding_window=WINDOW,
                                soft_cap=CAP, sinks=sinks))


def numpy_with_sink_column(q, pool, md, sinks, window, soft_cap):
    """transformers' eager gpt-oss attention, token by token: the head's sink appended to
    the row's scaled (capped) logits, the max subtracted, softmax, the sink column dropped."""
    q, pool, sinks = np.asarray(q, np.float64), np.asarray(pool, np.float64), np.asarray(sinks)
    tables, lens = np.asarray(md.block_tables), np.asarray(md.kv_lens)
    seq_ids, q_pos, valid = (np.asarray(x) for x in token_positions(md, q.shape[0]))
    hkv, page = pool.shape[2], pool.shape[4]
    group = q.shape[1] // hkv
    out = np.zeros_like(q)
    for t in np.flatnonzero(valid):
        s, p = seq_ids[t], q_pos[t]
        keys = np.arange(lens[s])
        keys = keys[(keys <= p) & ((window <= 0) | (p - keys < window))]
        slots = tables[s, keys // page], keys % page
        for h in range(q.shape[1]):
            k, v = (pool[1, kv, h // group][slots] for kv in (0, 1))  # [keys, D]
            logits = k @ q[t, h] * SCALE
            if soft_cap is not None:
                logits = soft_cap * np.tanh(logits / soft_cap)
            combined = np.append(logits, sinks[h])
            probs = np.exp(combined - combined.max())
            out[t, h] = (probs / probs.sum())[:-1] @ v
    return out


@pytest.mark.parametrize("window,soft_cap", [(0, None), (WINDOW, CAP)])
def test_reference_equals_a_softmax_with_a_sink_column(step, window, soft_cap):
    q, pool, md, sinks = step
    got = reference(q, pool, 1, md, sm_scale=SCALE, sliding_window=window, soft_cap=soft_cap,
                    sinks=sinks)
    np.testing.assert_allclose(np.asarray(got),
                               numpy_with_sink_column(q, pool, md, sinks, window, soft_cap),
                               atol=ATOL)
    plain = reference(q, pool, 1, md, sm_scale=SCALE, sliding_window=window, soft_cap=soft_cap)
    assert np.abs(np.asarray(got) - np.asarray(plain)).max() > 0.1  # the sinks matter here


def call(fn, step, **kw):
    """`fn(q, pool, 1, md, ...)` jitted, with the step's sinks, window and cap."""
    q, pool, md, sinks = step
    f = jax.jit(functools.partial(fn, sm_scale=SCALE, soft_cap=CAP, **kw))
    return np.asarray(f(q, pool, 1, md, sliding_window=WINDOW, sinks=sinks))


# The XLA path with the step's scale and cap (window and sinks traced): one compile with
# sinks, shared by the tests below, and one without.
xla_path = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=SCALE, soft_cap=CAP))


def test_xla_path_matches_the_reference(step, want):
    q, pool, md, sinks = step
    got = xla_path(q, pool, 1, md, sliding_window=WINDOW, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


@needs_kernel
def test_cpu_backend_matches_the_reference(step, want):
    # Every token of this step is a row of the C++ kernel (its contexts are short); the
    # sink scales the state the kernel returns.
    q, pool, md, sinks = step
    ops = AttentionOps("cpu")
    got = jax.jit(lambda q, p, md, s: ops.attend(q, p, 1, md, sm_scale=SCALE,
                                                 sliding_window=WINDOW, soft_cap=CAP,
                                                 sinks=s))(q, pool, md, sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


def test_pallas_ragged_kernel_matches_the_reference(step, want):
    got = call(ragged_paged_attention_kernel, step, block_q=4, pages_per_block=1,
               interpret=True)
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_pallas_decode_kernel_matches_the_reference(step, want):
    # Rows 0 and 1 of the step are its decodes (one token each, at their rows' indices).
    q, pool, md, sinks = step
    got = jax.jit(functools.partial(paged_decode_attention_kernel, sm_scale=SCALE,
                                    soft_cap=CAP, pages_per_block=2, num_splits=1,
                                    interpret=True))(
        q[:2], pool, 1, md.block_tables[:2], md.kv_lens[:2], sliding_window=WINDOW,
        sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want[:2], atol=ATOL)


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=needs_kernel)])
def test_batch_invariant_paths_match_the_reference(step, want, backend):
    got = call(functools.partial(ragged_paged_attention, backend=backend,
                                 batch_invariant=True), step)
    np.testing.assert_allclose(got, want, atol=ATOL)


@pytest.mark.slow  # the TPU interpreter compiles ~60 programs (tens of seconds)
def test_tpu_kernel_matches_the_reference_in_interpreter(step, want):
    got = call(ragged_paged_attention_tpu, step, block_q=8, pages_per_block=2, interpret=True)
    np.testing.assert_allclose(got, want, atol=ATOL)


def lowered_text(fn, platform: str, dtype: str, num_tokens: int = 32) -> str:
    """The text of `fn(q, kv, layer, md, window, sinks)` lowered for `platform` (no device)."""
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    q = jax.ShapeDtypeStruct((num_tokens, 6, 64), dtype)
    kv = jax.ShapeDtypeStruct((2, 2, 2, 32, 16, 64), dtype)
    md = AttentionMetadata(i32(num_tokens), i32(4, 8), i32(4), i32(5))
    sinks = jax.ShapeDtypeStruct((6,), jnp.float32)
    return jax.jit(fn).trace(q, kv, i32(), md, i32(), sinks).lower(
        lowering_platforms=(platform,)).as_text()


def test_tpu_kernel_with_sinks_lowers_to_mosaic(fake_tpu_info):
    def fn(q, kv, layer, md, window, sinks):
        return ragged_paged_attention_tpu(q, kv, layer, md, sm_scale=0.1, soft_cap=30.0,
                                          sliding_window=window, sinks=sinks)
    assert "tpu_custom_call" in lowered_text(fn, "tpu", "bfloat16")


def test_gpu_kernels_with_sinks_lower_to_triton():
    def fn(q, kv, layer, md, window, sinks):
        out = ragged_paged_attention_kernel(q, kv, layer, md, sm_scale=0.1, soft_cap=30.0,
                                            sliding_window=window, sinks=sinks)
        dec = paged_decode_attention_kernel(q[:4], kv, layer, md.block_tables, md.kv_lens,
                                            sm_scale=0.1, sliding_window=window, sinks=sinks,
                                            num_splits=2)
        return out, dec
    assert lowered_text(fn, "cuda", "float32").lower().count("triton") >= 2


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (CPU) devices")
def test_sinks_are_replicated_across_data_parallel_ranks():
    rng = np.random.default_rng(7)
    ranks = _ranks(2)
    md, parts = _step(2, rng)
    pool = jnp.asarray(rng.standard_normal((2, 2, 2, 16, 4, 16)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((md.slot_mapping.shape[0], 4, 16)), jnp.float32)
    sinks = jnp.asarray([1.0, -2.0, 3.0, 0.0], jnp.float32)
    # NOTE: the batch-invariant path compiles in a sixth of the XLA path's time; the ranks'
    # handling of sinks (a replicated argument) is the same for both.
    ops = AttentionOps("xla", batch_invariant=True, ranks=ranks)
    out = jax.jit(lambda q, p, md, s: ops.attend(q, p, 1, md, sm_scale=0.3, sinks=s))(
        q, _split(ranks, pool), md, sinks)
    for part, toks in parts:
        ref = reference(q[toks], pool, 1, part, sm_scale=0.3, sinks=sinks)
        real = int(part.cu_q_lens[-1])
        np.testing.assert_allclose(np.asarray(out[toks])[:real], np.asarray(ref)[:real],
                                   atol=ATOL)


def test_no_sinks_leaves_the_xla_program_and_its_result_unchanged(step):
    q, pool, md, _ = step
    # A sink of -inf takes no mass (its factor is exactly 1): the same bits as no sink.
    none = xla_path(q, pool, 1, md, sliding_window=WINDOW)
    minus_inf = xla_path(q, pool, 1, md, sliding_window=WINDOW,
                         sinks=jnp.full(4, -jnp.inf, jnp.float32))
    np.testing.assert_array_equal(np.asarray(none), np.asarray(minus_inf))


BAD_SINKS = [jnp.zeros(3, jnp.float32), jnp.zeros((1, 4), jnp.float32),
             jnp.zeros(4, jnp.int32), [0.0] * 4]


@pytest.mark.parametrize("sinks", BAD_SINKS, ids=["short", "2d", "int", "list"])
@pytest.mark.parametrize("fn", [
    ragged_paged_attention_reference, ragged_paged_attention_xla,
    functools.partial(ragged_paged_attention_kernel, interpret=True),
    functools.partial(ragged_paged_attention_tpu, interpret=True), invariant_attention,
    functools.partial(ragged_paged_attention, backend="pallas"),
], ids=["reference", "xla", "pallas", "tpu", "invariant", "ops"])
def test_bad_sinks_are_value_errors_naming_sinks(step, fn, sinks):
    q, pool, md, _ = step
    with pytest.raises(ValueError, match="sinks"):
        fn(q, pool, 1, md, sm_scale=SCALE, sinks=sinks)


def test_bad_sinks_in_the_decode_kernel_and_attention_ops(step):
    q, pool, md, _ = step
    with pytest.raises(ValueError, match=r"sinks must be f32\[num_q_heads = 4\]"):
        paged_decode_attention_kernel(q[:2], pool, 1, md.block_tables[:2], md.kv_lens[:2],
                                      sm_scale=SCALE, sinks=jnp.zeros(5), interpret=True)
    with pytest.raises(ValueError, match="sinks"):
        AttentionOps("xla").attend(q, pool, 1, md, sm_scale=SCALE, sinks=jnp.zeros(2))

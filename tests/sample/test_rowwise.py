"""`rowwise`: the two-stage argmax and top-k equal `jnp.argmax` and `lax.top_k`; the CDF
draw follows softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sample.rowwise import BLOCK, argmax_rows, categorical_rows, top_k_rows

argmax_jit = jax.jit(argmax_rows)
draw_jit = jax.jit(categorical_rows)


@pytest.mark.parametrize("vocab", [7, BLOCK, 300, 4 * BLOCK])
def test_argmax_rows_equals_jnp_argmax(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((9, vocab)).astype(np.float32)
    x[1] = -np.inf  # every id banned: id 0, as jnp.argmax
    x[2, :] = 1.0  # ties everywhere: the first
    x[3, vocab // 2:] = 5.0  # ties across blocks: the first
    x[4, vocab - 1] = 50.0  # the last id (in the padded block when vocab % BLOCK)
    x[5, :BLOCK // 2] = -np.inf  # a banned first half-block
    x[6, [vocab - 2, vocab - 1]] = np.inf
    np.testing.assert_array_equal(argmax_jit(x), jnp.argmax(jnp.asarray(x), axis=-1))


def test_argmax_rows_of_bfloat16():
    x = jax.random.normal(jax.random.key(0), (4, 3 * BLOCK + 5)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(argmax_jit(x), jnp.argmax(x, axis=-1))


def test_draws_follow_softmax_and_never_take_banned_ids():
    vocab, n = 300, 100_000  # vocab not a multiple of BLOCK: a padded last block
    logits = np.random.default_rng(1).standard_normal(vocab).astype(np.float32) * 2
    logits[[0, 5, 129, vocab - 1]] = -np.inf
    p = np.asarray(jax.nn.softmax(logits))
    u = jax.random.uniform(jax.random.key(2), (n, 2))
    ids = np.asarray(draw_jit(jnp.broadcast_to(jnp.asarray(logits), (n, vocab)), u))
    counts = np.bincount(ids, minlength=vocab)
    assert counts[[0, 5, 129, vocab - 1]].sum() == 0
    live = p > 0
    chi2 = (((counts[live] - n * p[live]) ** 2) / (n * p[live])).sum()
    dof = live.sum() - 1
    # Far above dof + 5 sigma would mean a wrong distribution (chi2 ~ dof +- sqrt(2 dof)).
    assert chi2 < dof + 5 * np.sqrt(2 * dof), chi2


def test_draws_at_the_ends_of_the_unit_interval():
    vocab = 3 * BLOCK
    logits = np.full((4, vocab), -np.inf, np.float32)
    logits[:, [BLOCK + 3, 2 * BLOCK + 7, 2 * BLOCK + 9]] = [0.0, 1.0, 2.0]
    logits[3] = -np.inf  # nothing allowed: id 0
    u = np.array([0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5, 0.5], np.float32)
    u = np.stack([u, u], axis=1)  # the block's uniform and the id's
    ids = np.asarray(draw_jit(logits, u))
    assert ids[0] == BLOCK + 3  # the first id with mass
    assert ids[1] == 2 * BLOCK + 9  # the last id with mass, even where rounding falls short
    assert ids[2] in (2 * BLOCK + 7, 2 * BLOCK + 9)
    assert ids[3] == 0


def test_one_hot_rows_draw_their_id():
    vocab = 2 * BLOCK + 1
    logits = np.full((vocab, vocab), -np.inf, np.float32)
    logits[np.arange(vocab), np.arange(vocab)] = 0.0
    u = np.random.default_rng(3).uniform(size=(vocab, 2)).astype(np.float32)
    np.testing.assert_array_equal(draw_jit(logits, u), np.arange(vocab))


@pytest.mark.parametrize("vocab, k", [(300, 20), (4 * BLOCK + 5, 3), (64 * 16 + 7, 16)])
def test_top_k_rows_equals_lax_top_k(vocab, k):
    rng = np.random.default_rng(vocab + k)
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1, :-3] = -np.inf  # fewer than k values above -inf
    x[2, 100:100 + k] = 9.0  # the top k in one run of ids across blocks
    x[3, ::17] = 4.0  # the top k spread one per block
    want_values, want_ids = jax.lax.top_k(jnp.asarray(x), k)
    values, ids = jax.jit(top_k_rows, static_argnums=1)(x, k)
    np.testing.assert_array_equal(values, want_values)
    real = np.isfinite(np.asarray(values))
    np.testing.assert_array_equal(np.asarray(ids)[real], np.asarray(want_ids)[real])
    assert (np.asarray(ids) < vocab).all()
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), 1)[real],
                                  np.asarray(values)[real])


def test_the_second_uniform_picks_the_id_inside_the_block():
    # Block 1 holds 1e-6 of the mass in two equal ids: the first uniform reaches it only
    # at its very end, and the second then splits it evenly, whatever the row's total.
    logits = np.full((3, 2 * BLOCK), -np.inf, np.float32)
    logits[:, 5] = 0.0
    logits[:, [BLOCK + 1, BLOCK + 2]] = np.log(0.5e-6)
    top = np.nextafter(np.float32(1), np.float32(0))
    u = np.array([[top, 0.25], [top, 0.75], [0.5, 0.75]], np.float32)
    assert np.asarray(draw_jit(logits, u)).tolist() == [BLOCK + 1, BLOCK + 2, 5]

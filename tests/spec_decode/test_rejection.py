"""The rejection-sampling rule: its tokens are distributed as the target's own samples."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.spec_decode.rejection import greedy_accept, one_hot_probs, rejection_sample

V, K = 6, 3
# NOTE: chi-square critical values at p = 0.001 (tables) for V - 1 = 5 degrees of freedom;
# each test then fails by chance about once in a thousand runs per comparison, and its
# seeds are fixed, so it either always passes or always fails.
CHI2_CRIT_5DF = 20.52


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target cannot produce was produced"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def dists(rng, n: int) -> np.ndarray:
    p = rng.dirichlet(np.full(V, 0.7), n).astype(np.float32)
    return p / p.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    target = dists(rng, K + 1)  # f32[K + 1, V]: the target at each position
    draft = dists(rng, K)  # f32[K, V]: a deliberately different draft
    return target, draft


def run_rows(target, draft, draft_ids, num_draft, seed=0):
    n = draft_ids.shape[0]
    keys = jax.random.split(jax.random.key(seed), n)
    return rejection_sample(jnp.asarray(draft_ids), jnp.broadcast_to(draft, (n, K, V)),
                            jnp.broadcast_to(target, (n, K + 1, V)),
                            jnp.asarray(num_draft), keys)


def test_tokens_follow_the_target_not_a_bad_draft(setup):
    target, draft = setup
    n = 20000
    rng = np.random.default_rng(1)
    # Proposals drawn from the draft, as a draft model would.
    draft_ids = np.stack([rng.choice(V, n, p=draft[i]) for i in range(K)], 1).astype(np.int32)
    tokens, count = map(np.asarray, run_rows(target, draft, draft_ids, np.full(n, K)))
    assert ((count >= 1) & (count <= K + 1)).all()
    # Position 0: the target's distribution.
    assert chi2(np.bincount(tokens[:, 0], minlength=V), target[0]) < CHI2_CRIT_5DF
    # Position 1 among rows that went on past an accepted first proposal equal to a fixed
    # token: still the target's distribution at that position.
    for tok in range(V):
        rows = (count >= 2) & (tokens[:, 0] == tok)
        if rows.sum() > 500:
            assert chi2(np.bincount(tokens[rows, 1], minlength=V), target[1]) < CHI2_CRIT_5DF
    # The draft is bad: many rejections, but not all.
    assert 0.1 < (count == 1).mean() < 0.9


def test_ngram_proposals_are_one_hot_drafts(setup):
    target, _ = setup
    n = 20000
    fixed = np.array([2, 0, 5], np.int32)  # n-gram proposals: the same for every row
    draft_ids = np.tile(fixed, (n, 1))
    q = one_hot_probs(jnp.asarray(fixed), V)
    tokens, count = map(np.asarray, run_rows(target, q, draft_ids, np.full(n, K), seed=3))
    assert chi2(np.bincount(tokens[:, 0], minlength=V), target[0]) < CHI2_CRIT_5DF
    # A one-hot draft is accepted exactly with the target's probability of it.
    assert abs((count >= 2).mean() - target[0][2]) < 4 * np.sqrt(target[0][2] / n)


def test_fewer_proposals_and_plain_decode_rows(setup):
    target, draft = setup
    draft_ids = np.tile(np.array([1, 2, 3], np.int32), (4, 1))
    tokens, count = map(np.asarray, run_rows(target, draft, draft_ids,
                                             np.array([0, 1, 2, 3]), seed=5))
    assert (count <= np.array([1, 2, 3, 4])).all() and (count >= 1).all()
    for row in range(4):  # nothing past the row's count, accepted tokens are proposals
        assert (tokens[row, count[row]:] == -1).all()
        assert (tokens[row, :count[row] - 1] == draft_ids[row, :count[row] - 1]).all()


def test_rows_do_not_depend_on_their_batch(setup):
    target, draft = setup
    rng = np.random.default_rng(7)
    draft_ids = rng.integers(0, V, (8, K)).astype(np.int32)
    keys = jax.random.split(jax.random.key(11), 8)
    args = (jnp.asarray(draft_ids), jnp.broadcast_to(draft, (8, K, V)),
            jnp.broadcast_to(target, (8, K + 1, V)), jnp.full(8, K, jnp.int32))
    whole = rejection_sample(*args, keys)
    for row in (0, 5):
        alone = rejection_sample(*(a[row:row + 1] for a in args), keys[row:row + 1])
        assert np.array_equal(np.asarray(alone[0])[0], np.asarray(whole[0])[row])


def test_greedy_rows_accept_the_argmax_prefix():
    argmax = np.array([[4, 1, 2, 0], [4, 1, 2, 0], [3, 3, 3, 3]], np.int32)
    draft_ids = np.array([[4, 1, 5], [4, 1, 2], [1, 3, 3]], np.int32)
    num = np.array([3, 3, 3])
    tokens, count = map(np.asarray, greedy_accept(jnp.asarray(draft_ids),
                                                  jnp.asarray(argmax), jnp.asarray(num)))
    assert count.tolist() == [3, 4, 1]
    assert tokens.tolist() == [[4, 1, 2, -1], [4, 1, 2, 0], [3, -1, -1, -1]]
    # The same through the probabilistic rule with one-hot (greedy) targets and drafts.
    p = one_hot_probs(jnp.asarray(argmax), 8)
    q = one_hot_probs(jnp.asarray(draft_ids), 8)
    t2, c2 = rejection_sample(jnp.asarray(draft_ids), q, p, jnp.asarray(num),
                              jax.random.split(jax.random.key(0), 3))
    assert np.asarray(c2).tolist() == count.tolist()
    assert np.asarray(t2).tolist() == tokens.tolist()

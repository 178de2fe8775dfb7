"""Min-p, top-k and top-p filters without a vocabulary sort: thresholds read off the top
`NUM_CANDIDATES` logits where they suffice, else found by bisection over the float order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.sample.rowwise import top_k_rows

# Bisection steps: the ordered keys span at most 2**32 values.
_NUM_SEARCH_STEPS = 32
# Largest logits per row from which top-k and top-p thresholds are read directly.
NUM_CANDIDATES = 128


def ordered_keys(x: jax.Array) -> jax.Array:
    """Maps floats to uint32 keys with the same order (-0.0 and +0.0 share a key).

    Args:
        x: f32[...] without NaN.

    Returns:
        u32[...] with `x < y` iff `key(x) < key(y)`.
    """
    x = jnp.where(x == 0.0, 0.0, x).astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 != 0, ~bits, bits | jnp.uint32(0x80000000))


def largest_key_where(keys: jax.Array, ok) -> jax.Array:
    """Per row, the largest key t in [min, max] of the row with `ok(t)` true.

    `ok` must be monotone (true up to some t, false above) and true at the row minimum;
    the answer is then always one of the row's keys, found exactly in 32 steps of one
    masked reduction each.

    Args:
        keys: u32[R, V] from `ordered_keys`.
        ok: Maps a candidate u32[R, 1] to bool[R].

    Returns:
        u32[R, 1].
    """
    lo = jnp.min(keys, axis=-1, keepdims=True)  # u32[R, 1]
    hi = jnp.max(keys, axis=-1, keepdims=True)  # u32[R, 1]

    def step(_, bounds):
        lo, hi = bounds
        mid = hi - (hi - lo) // 2  # lo + ceil((hi - lo) / 2), no overflow
        good = ok(mid)[:, None] | (mid == lo)  # bool[R, 1]; ok(lo) holds by contract
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    return lax.fori_loop(0, _NUM_SEARCH_STEPS, step, (lo, hi))[0]


def apply_filters(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Min-p, then top-k, then top-p (over the top-k renormalised probabilities).

    Each filter sets dropped logits to -inf. Min-p drops tokens whose probability is
    below `min_p` times the largest one. Top-k keeps the k largest logits (ties with the
    k-th kept). Top-p keeps the smallest set of largest tokens whose probability reaches
    p (ties with the smallest kept logit kept). Off values: min_p 0, k 0, p 1.

    NOTE: a full sort of [R, V] took 0.9 s for R=64, V=49152 on a 2-core CPU. The
    thresholds are read off each row's `NUM_CANDIDATES` largest logits (`top_k_rows`)
    where its k is at most that many and its top-p set lies among them. The other rows'
    thresholds are found by bisection over the logits' float order (32 masked reductions
    each over the row, exact too): apart, when they are at most half of the rows, else
    over the whole step (decided at run time).

    Args:
        logits: f32[R, V], already divided by temperature.
        top_k: i32[R]; 0 (or >= V) keeps all.
        top_p: f32[R] in (0, 1].
        min_p: f32[R] in [0, 1].

    Returns:
        f32[R, V] with the dropped tokens at -inf.
    """
    vocab_size = logits.shape[-1]
    max_logit = jnp.max(logits, axis=-1, keepdims=True)  # f32[R, 1]
    # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf drops nothing.
    logits = jnp.where(logits < max_logit + jnp.log(min_p)[:, None], -jnp.inf, logits)
    k = jnp.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)  # i32[R]
    if vocab_size <= NUM_CANDIDATES:
        return _bisected(logits, k, top_p)
    threshold, ok = _candidate_threshold(logits, max_logit, k, top_p)
    num_rows = logits.shape[0]
    few = max(1, num_rows // 2)  # rows bisected apart from the rest of the step

    def candidates_only() -> jax.Array:
        return jnp.where(logits >= threshold, logits, -jnp.inf)

    def some_rows_bisected() -> jax.Array:
        rows = jnp.argsort(ok)[:few]  # i32[few]: the unsettled rows first (False < True)
        sub = _bisected(logits[rows], k[rows], top_p[rows])  # f32[few, V]
        slot = jnp.zeros(num_rows, jnp.int32).at[rows].set(
            jnp.arange(few, dtype=jnp.int32))  # i32[R]: each picked row's index in `sub`
        picked = jnp.zeros(num_rows, jnp.bool_).at[rows].set(~ok[rows])  # bool[R]
        return jnp.where(picked[:, None], sub[slot], candidates_only())

    def all_rows_bisected() -> jax.Array:
        # NOTE: settled rows keep the candidates' threshold, so no row's kept set depends
        # on the others (the two ways can differ where p falls within an ulp of a sum).
        return jnp.where(ok[:, None], candidates_only(), _bisected(logits, k, top_p))

    num_unsettled = jnp.sum(~ok)
    branch = jnp.where(num_unsettled == 0, 0, jnp.where(num_unsettled <= few, 1, 2))
    return lax.switch(branch, [candidates_only, some_rows_bisected, all_rows_bisected])


def _candidate_threshold(logits: jax.Array, max_logit: jax.Array, k: jax.Array,
                         top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The smallest logit kept by top-k and top-p, read off the row's largest logits.

    Args:
        logits: f32[R, V] after min-p.
        max_logit: f32[R, 1] the row maximum (min-p keeps it).
        k: i32[R] in [1, V]; V keeps all.
        top_p: f32[R].

    Returns:
        (f32[R, 1] threshold, bool[R] whether the candidates sufficed for the row).
    """
    vocab_size = logits.shape[-1]
    vals = top_k_rows(logits, NUM_CANDIDATES)[0]  # f32[R, C], descending
    rows = jnp.arange(logits.shape[0])  # i32[R]
    use_k = k < vocab_size  # bool[R]
    kth = jnp.where(use_k, vals[rows, jnp.clip(k, 1, NUM_CANDIDATES) - 1],
                    -jnp.inf)[:, None]  # f32[R, 1]
    top = jnp.where(jnp.isfinite(max_logit), max_logit, 0.0)  # f32[R, 1]
    # Top-p probabilities: softmax over what top-k keeps (the denominator over all V).
    total = jnp.sum(jnp.where(logits >= kth, jnp.exp(logits - top), 0.0), axis=-1,
                    keepdims=True)  # f32[R, 1]
    probs = jnp.where(vals >= kth, jnp.exp(vals - top), 0.0) / total  # f32[R, C]
    reached = jnp.cumsum(probs, axis=-1) >= top_p[:, None]  # bool[R, C]
    # NOTE: the first candidate reaching p (XLA:CPU's cumsum need not be monotone in
    # the last ulp, so not a count of those below); C where none does.
    first = jnp.where(jnp.any(reached, axis=-1),
                      jnp.argmax(reached, axis=-1), NUM_CANDIDATES)  # i32[R]
    use_p = top_p < 1.0  # NOTE: top_p = 1 keeps everything exactly, whatever the sum
    pth = jnp.where(use_p, vals[rows, jnp.minimum(first, NUM_CANDIDATES - 1)],
                    -jnp.inf)[:, None]  # f32[R, 1]
    ok = (~use_k | (k <= NUM_CANDIDATES)) & (~use_p | (first < NUM_CANDIDATES))
    return jnp.maximum(kth, pth), ok


def _bisected(logits: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p by bisection over the float order (any k, any top-p set).

    Args:
        logits: f32[R, V] after min-p.
        k: i32[R] in [1, V]; V keeps all.
        top_p: f32[R].
    """
    vocab_size = logits.shape[-1]
    keys = ordered_keys(logits)  # u32[R, V]
    row_min = jnp.min(keys, axis=-1, keepdims=True)  # u32[R, 1]
    kth = lax.cond(
        jnp.any(k < vocab_size),
        lambda: largest_key_where(
            keys, lambda t: jnp.sum(keys >= t, axis=-1, dtype=jnp.int32) >= k),
        lambda: row_min)  # u32[R, 1]; the k-th largest key

    def top_p_threshold() -> jax.Array:
        probs = jax.nn.softmax(jnp.where(keys >= kth, logits, -jnp.inf), axis=-1)  # f32[R, V]
        pth = largest_key_where(
            keys, lambda t: jnp.sum(jnp.where(keys >= t, probs, 0.0), axis=-1) >= top_p)
        # NOTE: top_p = 1 keeps everything exactly, whatever the float sum reaches.
        return jnp.where(top_p[:, None] >= 1.0, row_min, pth)

    pth = lax.cond(jnp.any(top_p < 1.0), top_p_threshold, lambda: row_min)  # u32[R, 1]
    return jnp.where(keys >= jnp.maximum(kth, pth), logits, -jnp.inf)

"""The causal depthwise conv1d with carried state (`pallas_kernels.causal_conv1d`): per row
against transformers' `causal_conv1d_fn` (torch's Conv1d) and `causal_conv1d_update`, on a
ragged batch with shuffled slots; state carried across calls; slots no row owns left
alone; bad shapes and activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from pallas_kernels import AttentionOps, causal_conv1d
from pallas_kernels.causal_conv1d.reference import causal_conv1d_reference
from tests.kernels.gdn_cases import Batch

WIDTH, CHANNELS = 4, 6
# A decode row (shorter than W - 1: keeps part of its old state), a row continuing from a
# state, a fresh row, a fresh row of two tokens (shorter than W - 1); padding.
MIXED = Batch(q_lens=(1, 5, 9, 2), kv_lens=(7, 12, 9, 2), num_tokens=20, num_rows=6,
              num_slots=8)

conv = jax.jit(causal_conv1d_reference, static_argnames=("activation",))


def _inputs(batch: Batch, bias=True, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch.num_tokens, CHANNELS)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(WIDTH, CHANNELS)), jnp.float32)
    b = jnp.asarray(rng.normal(size=CHANNELS), jnp.float32) if bias else None
    slots, cu, kv = batch.metadata(seed)
    pool = batch.poisoned_pool((WIDTH - 1, CHANNELS), np.asarray(slots), rng)
    return x, w, b, pool, slots, cu, kv


@pytest.mark.parametrize("activation,bias", [("silu", True), (None, False)])
def test_matches_transformers_per_row(activation, bias):
    x, w, b, pool, slots, cu, kv = _inputs(MIXED, bias)
    y, new_pool = conv(x, w, b, pool, slots, cu, kv, activation=activation)
    tw = torch.from_numpy(np.array(w).T)  # [C, W], as transformers holds the Conv1d taps
    tb = None if b is None else torch.from_numpy(np.array(b))
    for i, (q_len, kv_len) in enumerate(zip(MIXED.q_lens, MIXED.kv_lens, strict=True)):
        lo, hi, s = int(cu[i]), int(cu[i + 1]), int(slots[i])
        rows = torch.from_numpy(np.array(x[lo:hi]).T)[None]  # [1, C, L]
        old = np.zeros((WIDTH - 1, CHANNELS), np.float32)
        if kv_len > q_len:
            old = np.array(pool[s])
        else:  # a fresh row: torch's zero-padded Conv1d
            want = hf.causal_conv1d_fn(rows, tw, tb, activation=activation)
            np.testing.assert_allclose(y[lo:hi], want[0].numpy().T, atol=1e-5, rtol=1e-5)
        state = torch.from_numpy(old.T.copy())[None]  # [1, C, W - 1], updated in place
        want = hf.causal_conv1d_update(rows, state, tw, tb, activation=activation)
        np.testing.assert_allclose(y[lo:hi], want[0].numpy().T, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(new_pool[s], state[0].numpy().T, atol=1e-6)
    np.testing.assert_array_equal(y[sum(MIXED.q_lens):], 0.0)
    owned = set(np.asarray(slots)[:len(MIXED.q_lens)].tolist())
    for s in set(range(MIXED.num_slots)) - owned:  # slot 0 and unused slots keep their NaN
        np.testing.assert_array_equal(new_pool[s], pool[s])


def test_state_carried_across_calls_equals_one_call():
    whole = Batch(q_lens=(11,), kv_lens=(11,), num_tokens=12, num_rows=2, num_slots=3)
    x, w, b, pool, slots, cu, kv = _inputs(whole)
    want_y, want_pool = conv(x, w, b, pool, slots, cu, kv)
    pieces, state = [], pool
    for lo, hi in ((0, 2), (2, 3), (3, 11)):  # pieces shorter and longer than W - 1
        n = hi - lo
        step = (jnp.asarray([0, n, n], jnp.int32), jnp.asarray([hi, 0], jnp.int32))
        y, state = conv(jnp.pad(x[lo:hi], ((0, 12 - n), (0, 0))), w, b, state, slots, *step)
        pieces.append(y[:n])
    np.testing.assert_allclose(jnp.concatenate(pieces), want_y[:11], atol=1e-6)
    np.testing.assert_allclose(state[int(slots[0])], want_pool[int(slots[0])], atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_ops_dispatch(backend):
    args = _inputs(MIXED)
    want, _ = conv(*args)
    got, _ = jax.jit(lambda *a: causal_conv1d(*a, backend=backend))(*args)
    np.testing.assert_allclose(got, want, atol=1e-6)
    got, _ = jax.jit(AttentionOps(backend).causal_conv1d)(*args)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_bad_shapes_name_the_argument():
    x, w, b, pool, slots, cu, kv = _inputs(MIXED)
    ok = dict(x=x, weight=w, bias=b, conv_state=pool, slots=slots, cu_q_lens=cu, kv_lens=kv)
    bad = {
        "x": (x[0], r"x must be \[num_tokens, channels\]"),
        "weight": (w[:, :5], r"weight \(4, 5\) must be \[width, channels=6\]"),
        "bias": (b[:5], r"bias \(5,\) must be \[channels\]"),
        "conv_state": (pool[:, :2], r"conv_state \(8, 2, 6\) must be .* \[num_slots, 3, 6\]"),
        "slots": (slots[:2], r"cu_q_lens \(7,\) must be \[num_rows \+ 1\] = \[3\]"),
        "kv_lens": (kv[:2], r"kv_lens \(2,\) must be"),
    }
    for name, (value, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            causal_conv1d_reference(**{**ok, name: value})
    with pytest.raises(ValueError, match=r"activation 'gelu' is not one of"):
        causal_conv1d_reference(**ok, activation="gelu")

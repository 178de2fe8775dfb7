"""Mamba-2's selective scan (`pallas_kernels.ssd`): the sequential reference against
transformers' own recurrent step and chunk scan per row, the chunked XLA form and the Pallas
kernel (in the interpreter) against the reference on ragged batches, state carried across
calls, the slots no row owns left alone, bad shapes; the kernel's Triton and Mosaic
lowerings."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

from pallas_kernels import AttentionOps, ssd
from pallas_kernels.ssd.kernel import ssd_kernel
from pallas_kernels.ssd.reference import ssd_reference
from pallas_kernels.ssd.xla import ssd_xla
from tests.kernels.gdn_cases import Batch

HEADS = dict(h=4, g=2, p=8, n=16)  # two heads per B/C group
# A decode row with a carried state, a row continuing from one, a fresh row of two chunks
# and a bit, a fresh short row, a row of one token that is its whole prompt; padding
# tokens and two padding rows.
MIXED = Batch(q_lens=(1, 5, 70, 3, 1), kv_lens=(9, 20, 70, 3, 1), num_tokens=96,
              num_rows=7, num_slots=10)
TOL = dict(atol=2e-4, rtol=1e-4)  # outputs reach ~15: f32 rounding of sums of ~70 terms

reference = jax.jit(ssd_reference)
xla = ssd_xla  # jitted itself: the ops dispatch below reuses its compilation


def ssd_inputs(batch: Batch, h: int, g: int, p: int, n: int, seed: int = 0):
    """(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens) for `batch`, with step sizes
    and decays in the ranges a Mamba-2 layer makes (softplus(dt + dt_bias), -exp(A_log)),
    NaN in every slot no row may read."""
    rng = np.random.default_rng(seed)
    t = batch.num_tokens
    x = rng.normal(size=(t, h, p))
    dt = np.log1p(np.exp(rng.normal(-2, 1, size=(t, h))))
    a = -rng.uniform(1, 16, h)
    b, c = rng.normal(size=(t, g, n)), rng.normal(size=(t, g, n))
    d = rng.normal(size=h)
    slots, cu, kv = batch.metadata(seed)
    state = batch.poisoned_pool((h, p, n), np.asarray(slots), rng)
    f = lambda v: jnp.asarray(v, jnp.float32)
    return f(x), f(dt), f(a), f(b), f(c), f(d), state, slots, cu, kv


@pytest.fixture(scope="module")
def mixed():
    args = ssd_inputs(MIXED, **HEADS)
    return args, reference(*args)


def _torch(v, lo=None, hi=None):
    return torch.from_numpy(np.array(v[lo:hi] if lo is not None else v))


def _hf_recurrent(x, dt, a, b, c, d, init):
    """transformers' decode step (`mamba2_selective_state_update`) over one row's tokens."""
    h, p = x.shape[1:]
    s = init.clone()
    a3 = a[:, None, None].expand(-1, p, b.shape[-1])
    ys = [hf.mamba2_selective_state_update(s, x[t][None], dt[t][None, :, None].expand(-1, -1, p),
                                           a3, b[t][None], c[t][None], d[:, None].expand(-1, p))
          for t in range(x.shape[0])]
    return torch.cat(ys), s[0]


def test_reference_matches_transformers_per_row(mixed):
    (x, dt, a, b, c, d, state, slots, cu, kv), (y, new_state) = mixed
    h, p = x.shape[1:]
    n = b.shape[-1]
    for i, q_len in enumerate(MIXED.q_lens):
        lo, hi = int(cu[i]), int(cu[i + 1])
        carried = MIXED.kv_lens[i] > q_len
        init = _torch(state[int(slots[i])])[None] if carried else torch.zeros(1, h, p, n)
        rows = [_torch(v, lo, hi) for v in (x, dt, b, c)]
        want_y, want_s = _hf_recurrent(rows[0], rows[1], _torch(a), rows[2], rows[3],
                                       _torch(d), init)
        np.testing.assert_allclose(y[lo:hi], want_y.numpy(), **TOL)
        np.testing.assert_allclose(new_state[int(slots[i])], want_s.numpy(), **TOL)
        # The chunk scan (chunks of 16: the 70-token row has five, the last partial).
        want_y, want_s = hf.mamba2_chunk_scan(
            rows[0][None], rows[1][None], _torch(a), rows[2][None], rows[3][None],
            chunk_size=16, D=_torch(d), initial_states=init if carried else None,
            return_final_states=True)
        np.testing.assert_allclose(y[lo:hi], want_y[0].numpy(), **TOL)
        np.testing.assert_allclose(new_state[int(slots[i])], want_s[0].numpy(), **TOL)


def _check_against(got, want, state, slots, q_lens):
    y, new_state = got
    want_y, want_state = want
    np.testing.assert_allclose(y, want_y, **TOL)
    np.testing.assert_array_equal(y[sum(q_lens):], 0.0)  # padding tokens
    owned = {int(s) for s in np.asarray(slots)[:len(q_lens)]}
    for s in range(state.shape[0]):
        if s in owned:
            np.testing.assert_allclose(new_state[s], want_state[s], **TOL)
        else:  # slot 0 and unused slots keep their NaN
            np.testing.assert_array_equal(new_state[s], state[s])


def test_chunked_form_matches_reference_on_a_ragged_batch(mixed):
    args, want = mixed
    _check_against(xla(*args), want, args[6], args[7], MIXED.q_lens)
    assert np.isfinite(np.asarray(want[0])).all()  # no NaN from fresh rows' slots


def test_state_carried_across_calls_equals_one_call():
    # One prompt of 90 tokens (beside a decode row), in one call or cut at 37 and 38; every
    # call has MIXED's shapes (one compilation).
    whole = dataclasses.replace(MIXED, q_lens=(90, 1), kv_lens=(90, 5))
    x, dt, a, b, c, d, state, slots, cu, kv = ssd_inputs(whole, **HEADS)
    want_y, want_state = xla(x, dt, a, b, c, d, state, slots, cu, kv)
    r0, rows, tokens = int(slots[0]), MIXED.num_rows, MIXED.num_tokens
    pieces, pool = [], state
    for lo, hi in ((0, 37), (37, 38), (38, 90)):  # the middle piece a decode step
        n = hi - lo

        def take(v, lo=lo, hi=hi):
            return jnp.pad(v[lo:hi], [(0, tokens - hi + lo)] + [(0, 0)] * (v.ndim - 1))

        one = (jnp.asarray([r0] + [0] * (rows - 1), jnp.int32),
               jnp.asarray([0] + [n] * rows, jnp.int32),
               jnp.asarray([hi] + [0] * (rows - 1), jnp.int32))
        y, pool = xla(*(take(v) for v in (x, dt)), a, *(take(v) for v in (b, c)), d, pool,
                      *one)
        pieces.append(y[:n])
    np.testing.assert_allclose(jnp.concatenate(pieces), want_y[:90], **TOL)
    np.testing.assert_allclose(pool[r0], want_state[r0], **TOL)


# The GPU form (Triton's) with two blocks of head-dim rows and chunks of 32 (three for the
# long row); the TPU form (Mosaic's, its own interpreter: ~3 s) in the slow tier.
@pytest.mark.parametrize("target,chunk,block_p", [
    ("gpu", 32, 4),
    pytest.param("tpu", 64, None, marks=pytest.mark.slow),
])
def test_kernel_matches_reference_in_interpreter(mixed, target, chunk, block_p):
    args, want = mixed
    got = ssd_kernel(*args, chunk=chunk, block_p=block_p, interpret=True, target=target)
    _check_against(got, want, args[6], args[7], MIXED.q_lens)


def test_steep_decays_stay_finite(mixed):
    # dt a down to ~-200 per token: exp of a chunk's cumulative decay underflows to 0 (never
    # inf * 0); same shapes as MIXED, so both forms reuse their compilations.
    args, _ = mixed
    steep = (args[0], args[1] * 40, *args[2:])
    want = reference(*steep)
    assert np.isfinite(np.asarray(want[0])).all()
    _check_against(xla(*steep), want, args[6], args[7], MIXED.q_lens)
    got = ssd_kernel(*steep, chunk=32, block_p=4, interpret=True, target="gpu")
    _check_against(got, want, args[6], args[7], MIXED.q_lens)


# "pallas" runs the kernel in the interpreter again (~3 s): slow tier.
@pytest.mark.parametrize("backend", ["cpu", pytest.param("pallas", marks=pytest.mark.slow)])
def test_ops_dispatch_and_attention_ops(mixed, backend):
    args, want = mixed
    y, _ = ssd(*args, backend=backend)
    np.testing.assert_allclose(y, want[0], **TOL)
    y, _ = AttentionOps(backend).ssd(*args)
    np.testing.assert_allclose(y, want[0], **TOL)


def test_bad_shapes_name_the_argument():
    x, dt, a, b, c, d, state, slots, cu, kv = ssd_inputs(
        Batch(q_lens=(3,), kv_lens=(3,), num_tokens=4, num_rows=2, num_slots=3), **HEADS)
    ok = dict(x=x, dt=dt, a=a, b=b, c=c, d=d, state=state, slots=slots, cu_q_lens=cu,
              kv_lens=kv)
    bad = {
        "x": (x[0], r"x must be \[num_tokens"),
        "dt": (dt[:3], r"dt \(3, 4\) must be \[num_tokens, num_heads\]"),
        "a": (a[:3], r"a \(3,\) must be \[num_heads\]"),
        "d": (d[None], r"d \(1, 4\) must be \[num_heads\]"),
        "b": (b[:, :, None], r"b must be \[num_tokens=4, num_groups, state_size\]"),
        "c": (c[:, :1], r"c \(4, 1, 16\) must have b's shape"),
        "state": (state[..., :8], r"state \(3, 4, 8, 8\) must be"),
        "slots": (slots[None], r"slots must be i32\[num_rows\]"),
        "cu_q_lens": (cu[:2], r"cu_q_lens \(2,\) must be \[num_rows \+ 1\]"),
        "kv_lens": (kv[:1], r"kv_lens \(1,\) must be \[num_rows\]"),
    }
    for name, (value, match) in bad.items():
        for fn in (ssd_reference, ssd_xla, ssd_kernel):
            with pytest.raises(ValueError, match=match):
                fn(**{**ok, name: value})
    three = dict(ok, b=jnp.zeros((4, 3, 16)), c=jnp.zeros((4, 3, 16)))
    with pytest.raises(ValueError, match=r"b's 3 groups .* do not divide x's 4 heads"):
        ssd_reference(**three)
    with pytest.raises(ValueError, match=r"chunk 24 must be a multiple of 16"):
        ssd_kernel(**ok, chunk=24)
    with pytest.raises(ValueError, match=r"block_p 3 must divide head_dim 8"):
        ssd_kernel(**ok, block_p=3)


def _abstract(t=128, r=8, s=16, h=8, g=1, p=64, n=128):  # Granite 4.0's head and state sizes
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return (f32(t, h, p), f32(t, h), f32(h), f32(t, g, n), f32(t, g, n), f32(h),
            f32(s, h, p, n), i32(r), i32(r + 1), i32(r))


def test_kernel_lowers_to_triton():
    fn = functools.partial(ssd_kernel, target="gpu")
    lowered = jax.jit(fn).trace(*_abstract()).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


def test_kernel_lowers_to_mosaic(fake_tpu_info):
    fn = functools.partial(ssd_kernel, target="tpu")
    lowered = jax.jit(fn).trace(*_abstract()).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()

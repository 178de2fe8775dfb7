"""The gated delta rule (`pallas_kernels.gated_delta`): the sequential reference against
transformers' own recurrences per row, the chunked XLA form and the Pallas kernel (in the
interpreter) against the reference on ragged batches, state carried across calls, the
slots no row owns left alone, bad shapes; the kernel's Triton and Mosaic lowerings."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from pallas_kernels import AttentionOps, gated_delta_rule
from pallas_kernels.gated_delta.kernel import gated_delta_rule_kernel
from pallas_kernels.gated_delta.reference import gated_delta_rule_reference
from pallas_kernels.gated_delta.xla import gated_delta_rule_xla
from tests.kernels.gdn_cases import Batch, gdn_inputs

HEADS = dict(hk=2, hv=4, dk=16, dv=8)
# A decode row with a carried state, a row continuing from one, a fresh row of two chunks
# and a bit, a fresh short row, a row of one token that is its whole prompt; padding
# tokens and two padding rows.
MIXED = Batch(q_lens=(1, 5, 70, 3, 1), kv_lens=(9, 20, 70, 3, 1), num_tokens=96,
              num_rows=7, num_slots=10)

reference = jax.jit(gated_delta_rule_reference)
xla = jax.jit(gated_delta_rule_xla)


@pytest.fixture(scope="module")
def mixed():
    args = gdn_inputs(MIXED, **HEADS)
    return args, reference(*args)


def _torch(x, lo, hi):  # one row's tokens as a batch of one: [1, L, H, ...]
    return torch.from_numpy(np.array(x[lo:hi]))[None]


def test_reference_matches_transformers_per_row(mixed):
    (q, k, v, g, beta, state, slots, cu, kv), (out, new_state) = mixed
    dk = q.shape[-1]
    for i, q_len in enumerate(MIXED.q_lens):
        lo, hi = int(cu[i]), int(cu[i + 1])
        init = None
        if MIXED.kv_lens[i] > q_len:
            init = torch.from_numpy(np.array(state[int(slots[i])]))[None]
        # transformers scales q by dk ** -0.5 itself; the kernel's caller has done it.
        args = (_torch(q, lo, hi) * dk ** 0.5, _torch(k, lo, hi), _torch(v, lo, hi),
                _torch(g, lo, hi), _torch(beta, lo, hi))
        for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
            want_out, want_state = fn(*args, initial_state=init, output_final_state=True)
            np.testing.assert_allclose(out[lo:hi], want_out[0].numpy(), atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(new_state[int(slots[i])], want_state[0].numpy(),
                                       atol=2e-5, rtol=1e-4)


def _check_against(got, want, state, slots, q_lens):
    out, new_state = got
    want_out, want_state = want
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(out[sum(q_lens):], 0.0)  # padding tokens
    owned = {int(s) for s in np.asarray(slots)[:len(q_lens)]}
    for s in range(state.shape[0]):
        if s in owned:
            np.testing.assert_allclose(new_state[s], want_state[s], atol=2e-5, rtol=1e-4)
        else:  # slot 0 and unused slots keep their NaN
            np.testing.assert_array_equal(new_state[s], state[s])


def test_chunked_form_matches_reference_on_a_ragged_batch(mixed):
    args, want = mixed
    _check_against(xla(*args), want, args[5], args[6], MIXED.q_lens)
    assert np.isfinite(np.asarray(want[0])).all()


def test_state_carried_across_calls_equals_one_call():
    # One prompt of 100 tokens (beside a decode row), in one call or cut at 37.
    whole = Batch(q_lens=(100, 1), kv_lens=(100, 5), num_tokens=104, num_rows=3,
                  num_slots=4)
    q, k, v, g, beta, state, slots, cu, kv = gdn_inputs(whole, **HEADS)
    want_out, want_state = xla(q, k, v, g, beta, state, slots, cu, kv)
    r0 = int(slots[0])
    pieces, pool = [], state
    for lo, hi in ((0, 37), (37, 100)):
        n = hi - lo
        take = lambda x, lo=lo, n=n: jnp.pad(x[lo:lo + n], [(0, 64 - n)] + [(0, 0)] * (x.ndim - 1))
        one = (jnp.asarray([r0, 0], jnp.int32), jnp.asarray([0, n, n], jnp.int32),
               jnp.asarray([hi, 0], jnp.int32))
        out, pool = xla(*(take(x) for x in (q, k, v, g, beta)), pool, *one)
        pieces.append(out[:n])
    np.testing.assert_allclose(jnp.concatenate(pieces), want_out[:100], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(pool[r0], want_state[r0], atol=2e-5, rtol=1e-4)


# The GPU form (Triton's) with two blocks of value columns and chunks of 32 (three for the
# long row); the TPU form (Mosaic's, its own interpreter: ~5 s) in the slow tier.
@pytest.mark.parametrize("target,chunk,block_v", [
    ("gpu", 32, 4),
    pytest.param("tpu", 64, None, marks=pytest.mark.slow),
])
def test_kernel_matches_reference_in_interpreter(mixed, target, chunk, block_v):
    args, want = mixed
    got = gated_delta_rule_kernel(*args, chunk=chunk, block_v=block_v, interpret=True,
                                  target=target)
    _check_against(got, want, args[5], args[6], MIXED.q_lens)


# The kernel in the interpreter takes ~7 s here: slow tier.
@pytest.mark.parametrize("form", ["xla", pytest.param("kernel", marks=pytest.mark.slow)])
def test_repeated_keys_stay_accurate(form):
    # Three keys repeated with beta ~1 and almost no decay: the UT system's inverse is
    # small but its Neumann series' terms are not (a forward substitution is needed).
    batch = Batch(q_lens=(128,), kv_lens=(128,), num_tokens=128, num_rows=1, num_slots=2)
    q, k, v, g, beta, state, slots, cu, kv = gdn_inputs(batch, hk=1, hv=1, dk=16, dv=8)
    args = (q, jnp.tile(k[:3], (43, 1, 1))[:128], v, jnp.full_like(g, -1e-4),
            jnp.full_like(beta, 0.999), state, slots, cu, kv)
    want = reference(*args)
    fn = xla if form == "xla" else functools.partial(gated_delta_rule_kernel, interpret=True,
                                                     target="gpu")
    out, new_state = fn(*args)
    np.testing.assert_allclose(out, want[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(new_state[1], want[1][1], atol=2e-5, rtol=1e-4)


# "pallas" runs the kernel in the interpreter again (~3 s): slow tier.
@pytest.mark.parametrize("backend", ["cpu", pytest.param("pallas", marks=pytest.mark.slow)])
def test_ops_dispatch_and_attention_ops(mixed, backend):
    args, want = mixed
    out, state = gated_delta_rule(*args, backend=backend)
    np.testing.assert_allclose(out, want[0], atol=2e-5, rtol=1e-4)
    out, _ = AttentionOps(backend).gated_delta_rule(*args)
    np.testing.assert_allclose(out, want[0], atol=2e-5, rtol=1e-4)


def test_bad_shapes_name_the_argument():
    q, k, v, g, beta, state, slots, cu, kv = gdn_inputs(
        Batch(q_lens=(3,), kv_lens=(3,), num_tokens=4, num_rows=2, num_slots=3), **HEADS)
    ok = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, slots=slots, cu_q_lens=cu,
              kv_lens=kv)
    bad = {
        "q": (q[0], r"q must be \[num_tokens"),
        "k": (k[:3], r"k \(3, 2, 16\) must have q's shape"),
        "v": (v[:, :3], r"v's 3 value heads .* not a multiple of q/k's 2 key heads"),
        "g": (g[:3], r"g \(3, 4\) must be \[num_tokens, num_v_heads\]"),
        "beta": (beta[:, :2], r"beta \(4, 2\) must be"),
        "state": (state[:, :, :8], r"state \(3, 4, 8, 8\) must be"),
        "slots": (slots[None], r"slots must be i32\[num_rows\]"),
        "cu_q_lens": (cu[:2], r"cu_q_lens \(2,\) must be \[num_rows \+ 1\]"),
        "kv_lens": (kv[:1], r"kv_lens \(1,\) must be \[num_rows\]"),
    }
    for name, (value, match) in bad.items():
        for fn in (gated_delta_rule_reference, gated_delta_rule_xla, gated_delta_rule_kernel):
            with pytest.raises(ValueError, match=match):
                fn(**{**ok, name: value})
    with pytest.raises(ValueError, match=r"chunk 24 must be a multiple of 16"):
        gated_delta_rule_kernel(**ok, chunk=24)
    with pytest.raises(ValueError, match=r"block_v 3 must divide dv 8"):
        gated_delta_rule_kernel(**ok, block_v=3)


def _abstract(t=128, r=8, s=16, hk=2, hv=4, dk=128, dv=128):
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return (f32(t, hk, dk), f32(t, hk, dk), f32(t, hv, dv), f32(t, hv), f32(t, hv),
            f32(s, hv, dk, dv), i32(r), i32(r + 1), i32(r))


def test_kernel_lowers_to_triton():
    fn = functools.partial(gated_delta_rule_kernel, target="gpu")
    lowered = jax.jit(fn).trace(*_abstract()).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


def test_kernel_lowers_to_mosaic(fake_tpu_info):
    fn = functools.partial(gated_delta_rule_kernel, target="tpu")
    lowered = jax.jit(fn).trace(*_abstract()).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()

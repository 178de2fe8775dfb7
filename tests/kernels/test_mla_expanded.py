"""The expanded form of MLA over latent pages (per-head keys and values rebuilt from the
gathered latents, `mla_attention_expanded_xla`), alone and with its decode rows absorbed,
against the jnp expanded reference; its op through `AttentionOps`; bad shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionOps
from pallas_kernels.mla.reference import mla_expanded_reference
from pallas_kernels.mla.xla import mla_attention_expanded_xla
from tests.kernels.test_mla import HEADS, RANK, SCALE, geometry, inputs

DN, DV = 8, 12  # qk_nope_head_dim, v_head_dim


@pytest.fixture(scope="module")
def case():
    """(q_nope, q_pe, pool, md, w_uk, w_uv), the reference's f32[T, H, Dv]: `test_mla`'s
    ragged step (decode rows, first and later chunks, padding; NaN in free and null pages)."""
    _, q_pe, pool, md = inputs(geometry())
    rng = np.random.default_rng(1)
    w_uk = jnp.asarray(rng.standard_normal((RANK, HEADS, DN)) / 4, jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((RANK, HEADS, DV)), jnp.float32)
    q_nope = jnp.asarray(rng.standard_normal((md.slot_mapping.shape[0], HEADS, DN)),
                         jnp.float32)
    args = (q_nope, q_pe, pool, md, w_uk, w_uv)
    ref = jax.jit(functools.partial(mla_expanded_reference, sm_scale=SCALE))
    return args, np.asarray(ref(q_nope, q_pe, pool, 1, md, w_uk, w_uv))


# NOTE: the default tier runs the split (both forms, one compile); the model's numerics test
# (tests/models/test_numerics.py) runs the expanded decode pass.
@pytest.mark.parametrize("absorbed_decode", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["expanded", "absorbed_decode"])
def test_expanded_xla_matches_reference(case, absorbed_decode):
    (q_nope, q_pe, pool, md, w_uk, w_uv), want = case
    assert np.isfinite(want).all() and want[:int(md.cu_q_lens[-1])].any()
    # Small tiles: several key blocks per tile, several tiles per chunk, decode rows sharing
    # iterations.
    fn = jax.jit(functools.partial(mla_attention_expanded_xla, sm_scale=SCALE, block_kv=8,
                                   block_q=4, decode_block_kv=4, decode_rows=2,
                                   absorbed_decode=absorbed_decode))
    got = np.asarray(fn(q_nope, q_pe, pool, 1, md, w_uk, w_uv))
    assert got.shape == (md.slot_mapping.shape[0], HEADS, DV)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    assert not got[int(md.cu_q_lens[-1]):].any()  # padded tokens


@pytest.mark.slow  # a third compile at the tuned sizes; the model numerics tests call it too
def test_ops_attend_expanded(case):
    (q_nope, q_pe, pool, md, w_uk, w_uv), want = case
    ops = AttentionOps("xla")
    fn = jax.jit(functools.partial(ops.mla_attend_expanded, sm_scale=SCALE,
                                   absorbed_decode=True), static_argnums=3)
    got = np.asarray(fn(q_nope, q_pe, pool, 1, md, w_uk, w_uv))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


BAD = {  # words of the error -> how the arguments are broken
    "q_nope": lambda a: dict(q_nope=a["q_nope"][0]),
    "w_uk": lambda a: dict(w_uk=a["w_uk"][:, :, :DN - 1]),
    "w_uv": lambda a: dict(w_uv=a["w_uv"][:RANK - 1]),
    "kv_lora_rank": lambda a: dict(w_uk=a["w_uk"][:RANK - 1], w_uv=a["w_uv"][:RANK - 1]),
    "q_pe": lambda a: dict(q_pe=a["q_pe"][:, :2]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_shapes_name_the_argument(case, name):
    (q_nope, q_pe, pool, md, w_uk, w_uv), _ = case
    args = dict(q_nope=q_nope, q_pe=q_pe, w_uk=w_uk, w_uv=w_uv)
    args.update(BAD[name](args))
    with pytest.raises(ValueError, match=name):
        AttentionOps("xla").mla_attend_expanded(args["q_nope"], args["q_pe"], pool, 1, md,
                                                args["w_uk"], args["w_uv"], sm_scale=SCALE)


def test_batch_invariant_expanded_is_refused(case):
    (q_nope, q_pe, pool, md, w_uk, w_uv), _ = case
    with pytest.raises(ValueError, match="batch_invariant"):
        AttentionOps("xla", batch_invariant=True).mla_attend_expanded(
            q_nope, q_pe, pool, 1, md, w_uk, w_uv, sm_scale=SCALE)

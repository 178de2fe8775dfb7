"""The FP4 block-scaled matmul (`pallas_kernels.fp4_matmul`): the Pallas kernel in the
interpreter and the jnp reference against a NumPy oracle written here from the formats'
definitions (E2M1 by its bits, E8M0 as 2^(e - 127), NVFP4's e4m3 scale times a global
one), MXFP4 and NVFP4; its Triton and Mosaic lowerings; the ops dispatch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import fp4_matmul
from pallas_kernels.fp4_matmul.kernel import fp4_matmul_kernel
from pallas_kernels.fp4_matmul.reference import dequantize_fp4, fp4_matmul_reference

kernel = functools.partial(fp4_matmul_kernel, interpret=True)
BLOCK = {"mxfp4": 32, "nvfp4": 16}


def _e2m1(code: int) -> float:
    """E2M1 from its bits (OCP MX spec): sign, 2-bit exponent (bias 1), 1-bit mantissa."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -mag if sign else mag


def _weight(kind: str, k: int, n: int, seed: int = 0) -> tuple[dict, np.ndarray]:
    """Random leaves of a [k, n] weight and the NumPy oracle's dense weight."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 16, (k, n))  # one code per value, K-major
    codes = (values[0::2] | (values[1::2] << 4)).astype(np.uint8)  # row r: 2r low, 2r+1 high
    table = np.array([_e2m1(c) for c in range(16)], np.float32)
    kb = k // BLOCK[kind]
    if kind == "mxfp4":
        e = rng.integers(117, 135, (kb, n)).astype(np.uint8)
        w = {"qweight": codes, "e8m0_scales": e}
        scale = np.ldexp(np.float32(1), e.astype(np.int32) - 127).astype(np.float32)
    else:
        s = rng.uniform(0.5, 400, (kb, n)).astype(ml_dtypes.float8_e4m3fn)
        g = np.full((1, 1), 3e-4, np.float32)
        w = {"qweight": codes, "e4m3_scales": s, "global_scale": g}
        scale = s.astype(np.float32) * g
    dense = table[values] * np.repeat(scale, BLOCK[kind], axis=0)
    return {key: jnp.asarray(v) for key, v in w.items()}, dense


SLOW = pytest.mark.slow(reason="another shape of a kind the default tier runs")


@pytest.mark.parametrize("kind,k,n", [("mxfp4", 64, 48),
                                      pytest.param("mxfp4", 96, 128, marks=SLOW),
                                      pytest.param("nvfp4", 64, 40, marks=SLOW),
                                      ("nvfp4", 128, 32)])
def test_kernel_and_reference_match_numpy(kind, k, n):
    w, dense = _weight(kind, k, n)
    np.testing.assert_array_equal(np.asarray(dequantize_fp4(w, kind)), dense)
    x = jax.random.normal(jax.random.key(1), (5, k))
    want = np.asarray(x, np.float64) @ dense
    bound = 1e-6 * (np.abs(np.asarray(x, np.float64)) @ np.abs(dense))  # float32 sums
    for got in (fp4_matmul_reference(x, w, kind), kernel(x, w, kind)):
        assert (np.abs(np.asarray(got) - want) <= bound).all()


def test_every_code_and_exponent_decodes():
    """All 16 codes under E8M0 scales from 2^-125 to 2^125, in the reference and the kernel
    (x = I reads the weight back); 255 is NaN. (Below, 0.5 * 2^-126 is a subnormal, which
    XLA's CPU flushes to zero.)"""
    values = np.tile(np.arange(16), 2)[:, None]  # one block of 32 values, one column
    pairs = jnp.asarray((values[0::2] | (values[1::2] << 4)).astype(np.uint8))
    for e in (2, 126, 127, 130, 252):
        w = {"qweight": pairs, "e8m0_scales": jnp.full((1, 1), e, jnp.uint8)}
        scale = np.ldexp(np.float32(1), e - 127)
        want = np.array([_e2m1(c) for c in values[:, 0]], np.float32) * scale
        np.testing.assert_array_equal(np.asarray(dequantize_fp4(w, "mxfp4"))[:, 0], want)
        got = kernel(jnp.eye(32), w, "mxfp4")[:, 0]
        np.testing.assert_array_equal(np.asarray(got), want)
    w = {"qweight": pairs, "e8m0_scales": jnp.full((1, 1), 255, jnp.uint8)}
    assert np.isnan(np.asarray(dequantize_fp4(w, "mxfp4"))).all()


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_ops_dispatch_keeps_leading_axes(backend):
    w, dense = _weight("nvfp4", 64, 32)
    x = jax.random.normal(jax.random.key(2), (2, 3, 64))
    y = fp4_matmul(x, w, "nvfp4", backend=backend)
    assert y.shape == (2, 3, 32)
    np.testing.assert_allclose(y.reshape(6, 32), np.asarray(x).reshape(6, 64) @ dense,
                               rtol=1e-5, atol=1e-5)


def test_shape_errors_name_the_problem():
    w, _ = _weight("mxfp4", 64, 32)
    with pytest.raises(ValueError, match=r"e8m0_scales \(1, 32\) do not fit .*\[..., 2, 32\]"):
        fp4_matmul_reference(jnp.zeros((1, 64)), {**w, "e8m0_scales": w["e8m0_scales"][:1]},
                             "mxfp4")
    with pytest.raises(ValueError, match=r"qweight int8\[32, 32\] must be uint8 codes"):
        dequantize_fp4({**w, "qweight": w["qweight"].astype(jnp.int8)}, "mxfp4")
    with pytest.raises(ValueError, match=r"x \(1, 32\) must be \[M, 64\]"):
        kernel(jnp.zeros((1, 32)), w, "mxfp4")
    nv, _ = _weight("nvfp4", 32, 32)
    with pytest.raises(ValueError, match=r"global_scale \(1,\) must be \[..., 1, 1\]"):
        dequantize_fp4({**nv, "global_scale": jnp.ones((1,))}, "nvfp4")
    with pytest.raises(ValueError, match=r"K / 2 = 16 must be a multiple of it"):
        kernel(jnp.zeros((1, 32)), nv, "nvfp4", chunk=32)
    with pytest.raises(ValueError, match=r"unknown FP4 kind 'fp4'"):
        dequantize_fp4(nv, "fp4")


def _abstract(kind, k, n, dtype):
    w = {"qweight": jax.ShapeDtypeStruct((k // 2, n), jnp.uint8)}
    if kind == "mxfp4":
        w["e8m0_scales"] = jax.ShapeDtypeStruct((k // 32, n), jnp.uint8)
    else:
        w["e4m3_scales"] = jax.ShapeDtypeStruct((k // 16, n), jnp.float8_e4m3fn)
        w["global_scale"] = jax.ShapeDtypeStruct((1, 1), jnp.float32)
    return jax.ShapeDtypeStruct((32, k), dtype), w


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_kernel_lowers_to_triton(kind):
    x, w = _abstract(kind, 256, 256, jnp.bfloat16)
    fn = functools.partial(fp4_matmul_kernel, kind=kind, target="gpu")
    lowered = jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_kernel_lowers_to_mosaic(fake_tpu_info, kind):
    x, w = _abstract(kind, 256, 256, jnp.bfloat16)
    fn = functools.partial(fp4_matmul_kernel, kind=kind, target="tpu")
    lowered = jax.jit(fn).trace(x, w).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()

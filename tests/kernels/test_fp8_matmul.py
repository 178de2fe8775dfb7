"""The FP8 block-scaled matmul (`pallas_kernels.fp8_matmul`): the Pallas kernel in the
interpreter against the jnp reference, over block-wise (with edge blocks), per-channel and
per-tensor scales; its Triton and Mosaic lowerings; the ops dispatch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import fp8_matmul
from pallas_kernels.fp8_matmul.kernel import fp8_matmul_kernel
from pallas_kernels.fp8_matmul.reference import dequantize_fp8, fp8_matmul_reference

kernel = functools.partial(fp8_matmul_kernel, interpret=True)


def _weight(k: int, n: int, block: tuple[int, int], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 64, (k, n)).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.001, 0.01, (-(-k // block[0]), -(-n // block[1])))
    return {"qweight": jnp.asarray(q), "block_scales": jnp.asarray(scales, jnp.float32)}


@pytest.mark.parametrize("k,n,block", [
    (64, 96, (32, 32)),    # blocks divide both axes
    (80, 48, (32, 32)),    # an edge block of 16 along K and N
    (64, 48, (64, 1)),     # per channel
    (48, 40, (48, 40)),    # per tensor
])
def test_kernel_and_reference_match_numpy(k, n, block):
    w = _weight(k, n, block)
    x = jax.random.normal(jax.random.key(1), (5, k))
    # The numpy oracle: each (bk, bn) block of codes times its scale.
    dense = np.asarray(w["qweight"]).astype(np.float32)
    s = np.asarray(w["block_scales"])
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            dense[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= s[i, j]
    np.testing.assert_array_equal(np.asarray(dequantize_fp8(w, block)), dense)
    want = np.asarray(x) @ dense
    np.testing.assert_allclose(fp8_matmul_reference(x, w, block), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(kernel(x, w, block), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_ops_dispatch_keeps_leading_axes(backend):
    w = _weight(64, 32, (32, 32))
    x = jax.random.normal(jax.random.key(2), (2, 3, 64))
    y = fp8_matmul(x, w, (32, 32), backend=backend)
    assert y.shape == (2, 3, 32)
    np.testing.assert_allclose(y.reshape(6, 32), fp8_matmul_reference(x.reshape(6, 64), w,
                                                                       (32, 32)), atol=1e-4)


def test_shape_errors_name_the_problem():
    w = _weight(64, 32, (32, 32))
    with pytest.raises(ValueError, match=r"block_scales \(2, 1\) do not fit .* want \[..., 4, 2\]"):
        fp8_matmul_reference(jnp.zeros((1, 64)), w, (16, 16))
    with pytest.raises(ValueError, match=r"x \(1, 32\) must be \[M, 64\]"):
        kernel(jnp.zeros((1, 32)), w, (32, 32))


def _abstract(k, n, block, dtype):
    return (jax.ShapeDtypeStruct((32, k), dtype),
            {"qweight": jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
             "block_scales": jax.ShapeDtypeStruct((-(-k // block[0]), -(-n // block[1])),
                                                  jnp.float32)})


@pytest.mark.parametrize("block", [(128, 128), (256, 1)])
def test_kernel_lowers_to_triton(block):
    x, w = _abstract(256, 256, block, jnp.bfloat16)
    fn = functools.partial(fp8_matmul_kernel, block=block, target="gpu")
    lowered = jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


def test_kernel_lowers_to_mosaic(fake_tpu_info):
    x, w = _abstract(256, 256, (128, 128), jnp.bfloat16)
    fn = functools.partial(fp8_matmul_kernel, block=(128, 128), target="tpu")
    lowered = jax.jit(fn).trace(x, w).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()

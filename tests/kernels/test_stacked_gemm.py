"""The stacked-GEMM experiment (`scripts/bench_stacked_gemm.py`) against `jnp` matmuls."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu_decode import op as cpu_decode

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_stacked_gemm.py")

pytestmark = pytest.mark.skipif(not cpu_decode.available(),
                                reason="needs a C++ compiler and the CPU platform")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_stacked_gemm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    return rng.standard_normal((3, 40, 96)).astype(np.float32)  # [L, K, N]


@pytest.mark.parametrize("rows", [1, 5, 8, 13])
def test_every_layer_matches_jnp(script, weights, rows):
    x = np.random.default_rng(rows).standard_normal((rows, 40)).astype(np.float32)
    packed = script.pack(weights)
    # The layer index is traced, as in a layer loop.
    fn = jax.jit(lambda x, i: script.stacked_gemm(x, packed, i))
    for layer in range(3):
        np.testing.assert_allclose(np.asarray(fn(x, layer)), x @ weights[layer],
                                   rtol=1e-5, atol=1e-4)


def test_loop_over_layers_matches_jnp(script, weights):
    sq = np.random.default_rng(1).standard_normal((3, 96, 96)).astype(np.float32) * 0.1
    packed = script.pack(sq)
    x = np.random.default_rng(2).standard_normal((9, 96)).astype(np.float32)
    got = jax.jit(lambda x: jax.lax.fori_loop(
        0, 3, lambda i, x: jnp.tanh(script.stacked_gemm(x, packed, i)), x))(x)
    want = x
    for layer in range(3):
        want = np.tanh(want @ sq[layer])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_layer_index_is_clamped(script, weights):
    x = np.ones((2, 40), np.float32)
    packed = script.pack(weights)
    np.testing.assert_allclose(np.asarray(script.stacked_gemm(x, packed, 7)),
                               x @ weights[2], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(script.stacked_gemm(x, packed, -1)),
                               x @ weights[0], rtol=1e-5, atol=1e-4)


def test_columns_must_fill_panels(script):
    with pytest.raises(ValueError, match="not a multiple of 48"):
        script.pack(np.zeros((1, 8, 50), np.float32))


def test_mismatched_shapes_are_refused_by_the_kernel(script, weights):
    with pytest.raises(Exception, match="stacked_gemm: inconsistent shapes"):
        script.stacked_gemm(np.ones((2, 39), np.float32), script.pack(weights), 0)

"""The CPU LoRA kernel (`pallas_kernels/cpu_ffi/lora.py`) against a per-token NumPy loop:
every layer of the stacks at a traced index, ranks on each of its paths (whole vectors,
8-float vectors, scalar), odd widths, 1-13 rows and more, rows without an adapter, and
bad shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.linear.lora import resolve_impl
from pallas_kernels.cpu_ffi import lora as kernel

pytestmark = pytest.mark.skipif(not kernel.available(),
                                reason="needs a C++ compiler and the CPU platform")


def reference(y, x, slots, a, b, layer):
    """y + x[t] @ A[layer, :, s] @ B[layer, s] per row t of slot s >= 0, in float64."""
    out = y.astype(np.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] += x[t].astype(np.float64) @ a[layer, :, s] @ b[layer, s]
    return out


def stacks(rng, layers, d_in, num_slots, rank, d_out):
    a = rng.standard_normal((layers, d_in, num_slots, rank)).astype(np.float32)
    b = rng.standard_normal((layers, num_slots, rank, d_out)).astype(np.float32)
    return a, b


# NOTE: units are 8 rows of one slot: these counts leave every remainder per slot.
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 13, 40])
@pytest.mark.parametrize("rank,d_in,d_out", [(16, 64, 100), (8, 37, 19), (3, 24, 48),
                                             (32, 16, 145)])
def test_every_row_gets_its_own_slot(rows, rank, d_in, d_out):
    rng = np.random.default_rng(rows * 100 + rank)
    a, b = stacks(rng, 3, d_in, 4, rank, d_out)
    x = rng.standard_normal((rows, d_in)).astype(np.float32)
    y = rng.standard_normal((rows, d_out)).astype(np.float32)
    slots = rng.integers(-1, 4, rows).astype(np.int32)
    for layer in range(3):
        got = np.asarray(jax.jit(kernel.lora_sgmv)(y, x, slots, a, b, layer))
        np.testing.assert_allclose(got, reference(y, x, slots, a, b, layer),
                                   rtol=2e-4, atol=2e-4)
        np.testing.assert_array_equal(got[slots < 0], y[slots < 0])


def test_traced_layer_in_a_loop_and_no_adapter_rows():
    rng = np.random.default_rng(1)
    a, b = stacks(rng, 4, 32, 2, 16, 48)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    slots = np.asarray([1, -1, 0, 1, -1, 0], np.int32)

    @jax.jit
    def over_layers(y):
        return jax.lax.fori_loop(0, 4, lambda i, y: kernel.lora_sgmv(y, x, slots, a, b, i), y)

    y0 = np.zeros((6, 48), np.float32)
    want = y0
    for layer in range(4):
        want = reference(want, x, slots, a, b, layer).astype(np.float32)
    np.testing.assert_allclose(np.asarray(over_layers(y0)), want, rtol=1e-3, atol=1e-3)
    none = np.full(6, -1, np.int32)
    np.testing.assert_array_equal(np.asarray(kernel.lora_sgmv(y0 + 1, x, none, a, b, 2)),
                                  y0 + 1)


def test_bad_shapes_are_value_errors():
    a, b = np.zeros((2, 8, 2, 4), np.float32), np.zeros((2, 2, 4, 6), np.float32)
    x, y, slots = np.zeros((3, 8), np.float32), np.zeros((3, 6), np.float32), np.zeros(3, np.int32)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.lora_sgmv(y, x, slots, a, np.zeros((2, 2, 5, 6), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        kernel.lora_sgmv(y, np.zeros((3, 9), np.float32), slots, a, b)
    with pytest.raises(ValueError, match="rank at most 512"):
        kernel.lora_sgmv(y, x, slots, np.zeros((1, 8, 1, 513), np.float32),
                         np.zeros((1, 1, 513, 6), np.float32))


def test_resolve_impl_picks_the_kernel_only_where_it_serves():
    assert resolve_impl("auto", jnp.float32, True) == "grouped"
    assert resolve_impl("auto", jnp.bfloat16, True) == "masked"
    assert resolve_impl("auto", jnp.float32, False) == "masked"
    assert resolve_impl("gathered", jnp.bfloat16, False) == "gathered"
    with pytest.raises(ValueError, match="lora_impl='grouped' needs the CPU LoRA kernel: "
                                         "float32 weights on one CPU device"):
        resolve_impl("grouped", jnp.bfloat16, True)
    with pytest.raises(ValueError, match="a mesh"):
        resolve_impl("grouped", jnp.float32, False)
    with pytest.raises(ValueError, match="unknown LoRA impl 'bgmv'"):
        resolve_impl("bgmv", jnp.float32, True)

"""KV write: the Pallas kernel (interpret mode) equals the jnp scatter exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import write_kv
from pallas_kernels.kv_write.kernel import write_kv_kernel
from pallas_kernels.kv_write.reference import write_kv_reference
from tests.kernels.cases import slow_except


def _inputs(page_size, num_kv_heads, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    num_layers, num_pages, num_tokens = 3, 12, page_size + 4
    pool = rng.standard_normal((num_layers, 2, num_kv_heads, num_pages, page_size, head_dim))
    # A chunk that starts mid-page and crosses into a non-adjacent page, one decode token in
    # the last slot of a page, then padding (slot 0) for the rest.
    slots = [5 * page_size + 3 + i for i in range(page_size - 3)]
    slots += [9 * page_size, 9 * page_size + 1, 3 * page_size - 1]
    slots += [0] * (num_tokens - len(slots))
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(pool), cast(k), cast(v), jnp.asarray(slots, jnp.int32)


# NOTE: a compile per case; the kernel's code is the same for every shape. The default tier
# runs each dtype once, on two of the shapes; the other pairings in the slow tier.
@pytest.mark.parametrize("page_size,num_kv_heads,head_dim,dtype", slow_except(
    [(*shape, dtype) for shape in [(8, 2, 64), (16, 1, 128), (32, 4, 64)]
     for dtype in ["float32", "bfloat16"]], 0, 3))
def test_kernel_equals_reference_exactly(page_size, num_kv_heads, head_dim, dtype):
    pool, k, v, slots = _inputs(page_size, num_kv_heads, head_dim, dtype)
    before = np.asarray(pool, np.float32)
    want = np.asarray(write_kv_reference(pool, 1, k, v, slots), np.float32)
    got = np.asarray(write_kv_kernel(jnp.array(pool), 1, k, v, slots, interpret=True),
                     np.float32)
    np.testing.assert_array_equal(got, want)
    # What the reference wrote is what was asked, and nothing else moved.
    s = np.asarray(slots)
    real = s >= page_size
    np.testing.assert_array_equal(
        want[1, 0, :, s[real] // page_size, s[real] % page_size],
        np.asarray(k, np.float32)[real])
    np.testing.assert_array_equal(
        want[1, 1, :, s[real] // page_size, s[real] % page_size],
        np.asarray(v, np.float32)[real])
    touched = np.zeros(before.shape, bool)
    touched[1, :, :, s[real] // page_size, s[real] % page_size] = True
    np.testing.assert_array_equal(want[~touched], before[~touched])


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_write_is_in_place_under_jit_with_donation(backend):
    pool, k, v, slots = _inputs(16, 2, 64, "float32")
    step = jax.jit(lambda p, k, v, s: write_kv(p, 2, k, v, s, backend=backend),
                   donate_argnums=0)
    hlo = step.lower(pool, k, v, slots).compile().as_text()
    # The donated pool is aliased to the output: no second pool-sized buffer is produced.
    assert "input_output_alias" in hlo
    out = step(pool, k, v, slots)
    assert pool.is_deleted()
    assert out.shape == (3, 2, 2, 12, 16, 64)


def test_bad_shapes_raise():
    pool, k, v, slots = _inputs(12, 2, 64, "float32")
    with pytest.raises(ValueError, match=r"k \(16, 2, 32\) and v \(16, 2, 64\) must be"):
        write_kv_reference(pool, 0, k[..., :32], v, slots)
    with pytest.raises(ValueError, match=r"= \(15, 2, 64\) for kv_pages"):
        write_kv_kernel(pool, 0, k, v, slots[:15], interpret=True)
    with pytest.raises(ValueError, match="slot_mapping must be int32, got int64|got uint32"):
        write_kv_reference(pool, 0, k, v, np.asarray(slots, np.uint32))

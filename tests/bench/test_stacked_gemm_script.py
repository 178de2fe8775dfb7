"""`scripts/benchmarks/bench_stacked_gemm.py`: its layer loop through another build of the kernel
(`--compare-source`) computes what the engine's build does."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu_ffi import gemm
from pallas_kernels.cpu_ffi.build import register

pytestmark = pytest.mark.skipif(not gemm.available(),
                                reason="needs a C++ compiler and the CPU platform")


@pytest.fixture(scope="module")
def script():
    from scripts.benchmarks import bench_stacked_gemm

    return bench_stacked_gemm


def test_the_other_build_runs_the_same_layer_loop(script):
    assert register(gemm.SOURCE, "StackedGemm", script.OTHER_TARGET, "test", "none") is None
    rng = np.random.default_rng(0)
    # widths in whole panels, as the default model's (the loop runs at full panel width)
    shapes = {"q": (96, 96), "k": (96, 48), "v": (96, 48), "o": (96, 96), "g": (96, 144),
              "u": (96, 144), "d": (144, 96)}
    packed = {n: gemm.pack(rng.standard_normal((2, *s)).astype(np.float32) * 0.1)
              for n, s in shapes.items()}
    x = jnp.asarray(rng.standard_normal((5, 96)).astype(np.float32))
    ours = np.asarray(script.ffi_loop(packed, x))
    other = np.asarray(script.ffi_loop_of(script.OTHER_TARGET)(packed, x))
    np.testing.assert_array_equal(other, ours)
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0


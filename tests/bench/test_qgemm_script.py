"""`scripts/benchmarks/bench_qgemm.py`: its layer loops over the kernel's q4 and q8 panels
compute what XLA's quantized matmuls (the same blocks) and the float32 panels (the
dequantized values) do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quant import QuantFormat, quantize_stack
from pallas_kernels.cpu_ffi import gemm, qgemm
from pallas_kernels.quant_matmul.reference import dequantize

pytestmark = pytest.mark.skipif(not qgemm.available(),
                                reason="needs a C++ compiler, x86-64 AVX2/F16C and the CPU")


@pytest.fixture(scope="module")
def script():
    from scripts.benchmarks import bench_qgemm

    return bench_qgemm


def test_the_layer_loops_agree(script):
    rng = np.random.default_rng(0)
    shapes = {"q": (96, 96), "k": (96, 48), "v": (96, 48), "o": (96, 96), "g": (96, 160),
              "u": (96, 160), "d": (160, 96)}
    stacked = {n: rng.standard_normal((2, *s)).astype(np.float32) * 0.1
               for n, s in shapes.items()}
    meta = {"_layers": jnp.zeros((2,)),
            "_cols": {n: jnp.zeros((s[1],)) for n, s in shapes.items()}}
    q4 = {n: quantize_stack(QuantFormat("q4", 32), w) for n, w in stacked.items()}
    dense = {n: np.stack([np.asarray(dequantize({m: a[i] for m, a in leaves.items()}, "q4"))
                          for i in range(2)]) for n, leaves in q4.items()}
    loops = {"ours": (script.q4_loop, {n: qgemm.pack(w, "q4") for n, w in q4.items()}),
             "xla": (script.xla_q4_loop, jax.tree_util.tree_map(jnp.asarray, q4)),
             "f32": (script.float_loop, {n: gemm.pack(w) for n, w in dense.items()})}
    # 5 rows: the kernel splits x into two int8 parts (`qgemm.STAGE_ROWS`): ~15 bits of x's
    # block maximum, which this loop's unnormed, growing residual sums (no norm layers)
    # carry to ~1e-3 of the outputs' scale; 13 rows: float32 products.
    for rows, tol in ((5, 3e-2), (13, 1e-4)):
        x = jnp.asarray(rng.standard_normal((rows, 96)).astype(np.float32))
        out = {name: np.asarray(loop({**meta, **w}, x)) for name, (loop, w) in loops.items()}
        np.testing.assert_allclose(out["ours"], out["xla"], rtol=tol, atol=tol)
        np.testing.assert_allclose(out["ours"], out["f32"], rtol=tol, atol=tol)
        np.testing.assert_allclose(out["xla"], out["f32"], rtol=1e-4, atol=1e-4)
        assert np.isfinite(out["ours"]).all() and np.abs(out["ours"] - np.asarray(x)).max() > 0

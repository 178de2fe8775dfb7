"""Which matmuls give a row the same bits whatever the number of rows beside it: plain XLA's
dot, the same dot in fixed row tiles (`pallas_kernels.invariant.row_tiled`), and the `cpu`
backend's packed-weight kernel (`stacked_gemm`), at the default model's projection shapes
and its LM head's.

For each (K, N) a random row r is multiplied alone, then as row 0 and row 3 (the last of 2)
of random batches of 2 to 256 rows; printed: the row counts whose result differs from the row alone
in any bit ("-": none).

Usage: python scripts/probe_row_invariance.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_ffi import gemm
from pallas_kernels.invariant import row_tiled

SHAPES = [(576, 1536), (1536, 576), (576, 192), (576, 49152), (72, 216), (72, 49152)]
ROWS = (2, 4, 8, 16, 32, 64, 128, 256)


def differing(f, x) -> list[int]:
    want = np.asarray(f(x[:1]))[0]
    bad = set()
    for rows in ROWS:
        for pos in {0, min(3, rows - 1)}:
            got = np.asarray(f(x[:rows].at[pos].set(x[0])))[pos]
            if not np.array_equal(got, want):
                bad.add(rows)
    return sorted(bad)


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'K x N':>12}  {'XLA dot':28s} {'row tiles of 16':18s} packed kernel")
    for k, n in SHAPES:
        w = jnp.asarray(rng.standard_normal((1, k, n)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((256, k)), jnp.float32)
        plain = differing(jax.jit(lambda x, w=w: x @ w[0]), x)
        tiled = differing(jax.jit(lambda x, w=w: row_tiled(lambda t: t @ w[0], x, 16)), x)
        if gemm.available():
            panels = gemm.pack(w)
            packed = differing(jax.jit(lambda x, p=panels, n=n: gemm.stacked_gemm(x, p, 0, n)),
                               x)
        else:
            packed = "unavailable"
        show = lambda b: ",".join(map(str, b)) if isinstance(b, list) and b else (b or "-")
        print(f"{k:>5} x {n:<5}  {show(plain):28s} {show(tiled):18s} {show(packed)}")


if __name__ == "__main__":
    main()

"""On an accelerator: every attention path of `pallas_kernels.ops` (compiled for the device,
not interpreted) against the jnp reference, over the kernel tests' geometries and packings.

Prints one line per case with the max abs error and a final PASS/FAIL count; exit status 1
on any failure. Run by scripts/device_check.sh (a lent GPU or TPU machine); on the CPU it
runs the interpreted kernels instead, which is what CI already covers.

    python -m scripts.device_kernel_check
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from pallas_kernels import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.kernels.cases import make_metadata, make_pool, tolerance
from tests.kernels.test_ragged_paged_attention import GEOMETRIES, SM_SCALE
from tests.kernels.test_ragged_xla import LAYOUTS

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))


def case(g, q_lens, kv_lens, backend, window, decode_only, seed=0):
    rng = np.random.default_rng(seed)
    kv_lens = [min(k, g.width * g.page_size) for k in kv_lens]
    kv_pages, tables = make_pool(g, kv_lens, rng)
    md = make_metadata(g, q_lens, kv_lens, tables)
    q = rng.standard_normal((g.num_tokens, g.num_q_heads, g.head_dim)).astype(g.dtype)
    want = np.asarray(reference(q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=window),
                      np.float32)
    if decode_only:  # token i of request i: the paged decode kernel
        rows = np.cumsum(q_lens) - 1
        dmd = make_metadata(g, q_lens, kv_lens, tables, decode_only=True)
        got = np.asarray(ragged_paged_attention(q[rows], kv_pages, 1, dmd, sm_scale=SM_SCALE,
                                                sliding_window=window, backend=backend),
                         np.float32)
        return float(np.abs(got - want[rows]).max())
    got = np.asarray(ragged_paged_attention(q, kv_pages, 1, md, sm_scale=SM_SCALE,
                                            sliding_window=window, backend=backend), np.float32)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max())


def main() -> int:
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    passed = failed = 0
    start = time.perf_counter()
    for g in GEOMETRIES:
        for name, (q_lens, kv_lens) in LAYOUTS.items():
            for backend in ("pallas", "xla"):
                for window in (0, 5):
                    decode_only = name == "decode_only"
                    try:
                        err = case(g, q_lens, kv_lens, backend, window, decode_only)
                        ok = err <= tolerance(g.dtype)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        err, ok = f"{type(e).__name__}: {e}"[:200], False
                    passed += ok
                    failed += not ok
                    print(f"{'PASS' if ok else 'FAIL'} {g} {name} {backend} window={window}: "
                          f"max abs err {err}", flush=True)
    print(f"{passed} passed, {failed} failed in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

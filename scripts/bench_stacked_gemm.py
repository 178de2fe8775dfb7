"""Experiment: the layer loop's matmuls as a C++ custom call that reads each layer's weights
in place from stacked, panel-packed weights (`pallas_kernels/cpu_ffi/stacked_gemm.cc`),
against the model's `nn.scan` form and per-layer buffers (`bench_layer_loop.py`).

At decode batch sizes XLA's CPU matmul gains little from the second thread, and the scan
copies each layer's weights out of the stack before reading them. The custom call takes
the whole stack and the layer index (no copy) and gives each thread units of three
16-column panels of weights packed contiguously (`pack`: [L, K, N] -> [L, 3 N / 48, K, 16],
a load-time layout).
The engine's `cpu` backend serves float32 models this way (`models/packed.py`):

    python scripts/bench_stacked_gemm.py --batch-sizes 1,8,32,128

`--compare-source` times another version of the kernel's source beside this one, in the
same process (e.g. the version of a commit before a change to the kernel):

    git show c4feb93:pallas_kernels/cpu_decode/stacked_gemm.cc > /tmp/before.cc
    python scripts/bench_stacked_gemm.py --compare-source /tmp/before.cc --forms ffi

A version that reads another panel width (before 2026-12-04 the panels were 48 columns
wide, `[L, ceil(N / 48), K, 48]`) gets its weights packed that way with
`--compare-panel-width 48`.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_layer_loop import layer_weights, scanned, switched, time_forms  # noqa: E402

from pallas_kernels.cpu_ffi import gemm  # noqa: E402
from pallas_kernels.cpu_ffi.build import register  # noqa: E402
from pallas_kernels.cpu_ffi.gemm import pack  # noqa: E402

OTHER_TARGET = "jaxserve_bench_stacked_gemm_other"


def stacked_gemm(x, panels, layer, target: str = gemm.TARGET):
    """`gemm.stacked_gemm` at the panels' full width, through the registered FFI target
    `target` (the engine's build by default)."""
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[1] * panels.shape[3]), jnp.float32)
    return jax.ffi.ffi_call(target, out)(x, panels, jnp.asarray(layer, jnp.int32))


def ffi_loop_of(target: str):
    """`bench_layer_loop.layer` over every layer, each matmul a `stacked_gemm` (jitted)."""
    @jax.jit
    def loop(packed, x):
        def body(i, x):
            mm = lambda a, name: stacked_gemm(a, packed[name], i, target)
            q, k, v = mm(x, "q"), mm(x, "k"), mm(x, "v")
            x = x + mm(q + jnp.pad(k + v, ((0, 0), (0, q.shape[1] - k.shape[1]))), "o")
            return x + mm(jax.nn.silu(mm(x, "g")) * mm(x, "u"), "d")
        return jax.lax.fori_loop(0, packed["q"].shape[0], body, x)
    return loop


ffi_loop = ffi_loop_of(gemm.TARGET)


@jax.jit
def ffi_sliced(packed, x):
    """The same custom call inside a `lax.scan` that slices each layer's panels out of the
    stack first (the copy the model's scan makes today): what in-place reading saves."""
    def body(x, w):
        mm = lambda a, name: stacked_gemm(a, w[name][None], 0)
        q, k, v = mm(x, "q"), mm(x, "k"), mm(x, "v")
        x = x + mm(q + jnp.pad(k + v, ((0, 0), (0, q.shape[1] - k.shape[1]))), "o")
        return x + mm(jax.nn.silu(mm(x, "g")) * mm(x, "u"), "d"), None
    return jax.lax.scan(body, x, packed)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--iters", type=int, default=9)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    p.add_argument("--forms", default="scan,switch,ffi,ffi_sliced",
                   help="which forms to time (the first is the ratios' baseline)")
    p.add_argument("--compare-source", default=None,
                   help="another version of stacked_gemm.cc, timed as form 'other'")
    p.add_argument("--compare-panel-width", type=int, default=None,
                   help="the panel width that version reads (default: this tree's)")
    args = p.parse_args()
    if not gemm.available():  # builds and registers the engine's kernel
        raise SystemExit("the CPU matmul kernel is unavailable here")
    stacked, per_layer = layer_weights()
    packed = jax.block_until_ready({k: pack(w) for k, w in stacked.items()})
    forms = {"scan": (scanned, stacked), "switch": (switched, per_layer),
             "ffi": (ffi_loop, packed), "ffi_sliced": (ffi_sliced, packed)}
    forms = {n: forms[n] for n in args.forms.split(",")}
    if args.compare_source:
        error = register(os.path.abspath(args.compare_source), "StackedGemm", OTHER_TARGET,
                         f"the kernel of {args.compare_source}", "no 'other' form")
        if error:
            raise SystemExit(error)
        other = packed
        if args.compare_panel_width:
            other = jax.block_until_ready(
                {k: pack(w, args.compare_panel_width, unit=1) for k, w in stacked.items()})
        forms["other"] = (ffi_loop_of(OTHER_TARGET), other)
    hidden = stacked["q"].shape[1]
    for b in (1, 5, 32):  # full tiles and a remainder
        x = jnp.linspace(-0.05, 0.05, b * hidden, dtype=jnp.float32).reshape(b, hidden)
        for name, (fn, w) in forms.items():
            if name in ("ffi", "ffi_sliced", "other"):
                np.testing.assert_allclose(np.asarray(fn(w, x)),
                                           np.asarray(scanned(stacked, x)),
                                           rtol=2e-4, atol=2e-4, err_msg=name)
    time_forms(forms, hidden, [int(s) for s in args.batch_sizes.split(",")], args.rounds,
               args.iters)

if __name__ == "__main__":
    main()

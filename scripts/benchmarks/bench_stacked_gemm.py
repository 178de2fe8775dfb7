"""Benchmark: the layer loop's matmuls as a C++ custom call that reads each layer's weights
in place from stacked, panel-packed weights (`pallas_kernels/cpu_ffi/stacked_gemm.cc`),
against the model's `nn.scan` form and per-layer buffers (`lax.switch` over one branch
per layer, each closing over that layer's own buffer).

At decode batch sizes XLA's CPU matmul gains little from the second thread, and the scan
copies each layer's weights out of the stack before reading them. The custom call takes
the whole stack and the layer index (no copy) and gives each thread units of three
16-column panels of weights packed contiguously (`pack`: [L, K, N] -> [L, 3 N / 48, K, 16],
a load-time layout).
The engine's `cpu` backend serves float32 models this way (`models/linear/panels.py`):

    python -m scripts.benchmarks.bench_stacked_gemm --batch-sizes 1,8,32,128

`--compare-source` times another version of the kernel's source beside this one, in the
same process (e.g. the version of a commit before a change to the kernel):

    git show c4feb93:pallas_kernels/cpu_decode/stacked_gemm.cc > /tmp/before.cc
    python -m scripts.benchmarks.bench_stacked_gemm --compare-source /tmp/before.cc --forms ffi

A version that reads another panel width (before 2026-12-04 the panels were 48 columns
wide, `[L, ceil(N / 48), K, 48]`) gets its weights packed that way with
`--compare-panel-width 48`.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.roofline import median_seconds
from models.default_model import default_model_path
from models.linear import ServingChoice
from models.loaders import load_model
from pallas_kernels.cpu_ffi import gemm
from pallas_kernels.cpu_ffi.build import register
from pallas_kernels.cpu_ffi.gemm import pack

OTHER_TARGET = "jaxserve_bench_stacked_gemm_other"
NAMES = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"),
         "v": ("self_attn", "v_proj"), "o": ("self_attn", "o_proj"),
         "g": ("mlp", "gate_proj"), "u": ("mlp", "up_proj"), "d": ("mlp", "down_proj")}


def layer(x, w):
    """x [B, H] through one layer's matmuls (no attention: q, k, v feed o directly)."""
    qkv = x @ w["q"] + jnp.pad(x @ w["k"] + x @ w["v"],
                               ((0, 0), (0, w["q"].shape[1] - w["k"].shape[1])))
    x = x + qkv @ w["o"]
    return x + (jax.nn.silu(x @ w["g"]) * (x @ w["u"])) @ w["d"]


@jax.jit
def scanned(stacked, x):
    """`layer` over the stacked weights in a `lax.scan` (the model's form: each step
    slices its layer's weights out of the stack)."""
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0]


@jax.jit
def switched(per_layer, x):
    """`layer` in a `fori_loop` whose body picks the layer's own buffer by `lax.switch`
    (no slice of a stack)."""
    branches = [lambda x, w=w: layer(x, w) for w in per_layer]
    return jax.lax.fori_loop(0, len(per_layer),
                             lambda i, x: jax.lax.switch(i, branches, x), x)


def layer_weights() -> tuple[dict, list[dict]]:
    """The default model's layer matmul weights: stacked {name: [L, in, out]} and per layer."""
    params = load_model(default_model_path(), "float32",
                        serving=ServingChoice("xla")).params["layers"]
    stacked = {k: params[a][b]["kernel"] for k, (a, b) in NAMES.items()}  # [L, in, out]
    per_layer = jax.block_until_ready(
        [{k: jnp.array(w[i]) for k, w in stacked.items()}
         for i in range(stacked["q"].shape[0])])
    return stacked, per_layer


def time_forms(forms: dict, hidden: int, batch_sizes: list[int], rounds: int,
               iters: int) -> None:
    """Prints a table of ms per pass of each form {name: (fn, weights)}, interleaved
    rounds, and each form's ratio to the first."""
    names = list(forms)
    print("| round | batch | load avg | " + " | ".join(f"{n} ms" for n in names) + " | "
          + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |\n"
          + "|---:" * (3 + 2 * len(names) - 1) + "|")
    for r in range(rounds):
        for b in batch_sizes:
            x = jnp.ones((b, hidden), jnp.float32) * 0.01
            ms = [1000 * median_seconds(fn, w, x, iters=iters) for fn, w in forms.values()]
            print(f"| {r + 1} | {b} | {os.getloadavg()[0]:.2f} | "
                  + " | ".join(f"{m:.1f}" for m in ms) + " | "
                  + " | ".join(f"{m / ms[0]:.2f}" for m in ms[1:]) + " |", flush=True)


def stacked_gemm(x, panels, layer, target: str = gemm.TARGET):
    """`gemm.stacked_gemm` at the panels' full width, through the registered FFI target
    `target` (the engine's build by default)."""
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[1] * panels.shape[3]), jnp.float32)
    return jax.ffi.ffi_call(target, out)(x, panels, jnp.asarray(layer, jnp.int32))


def ffi_loop_of(target: str):
    """`layer` over every layer, each matmul a `stacked_gemm` (jitted)."""
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

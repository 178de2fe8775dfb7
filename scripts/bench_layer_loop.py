"""How the layer loop reaches its weights: stacked + scan (the model today) vs per-layer buffers.

The decoder runs its layers with `nn.scan` over weights stacked on a leading layer axis.
On XLA's CPU backend each iteration's `dynamic-slice` of a stacked weight is materialized
(a copy of the layer's 14 MB before its matmuls read it), which a thunk-level profile of
the decode step shows as `dynamic-slice_bitcast_fusion` kernels. This benchmark runs the
default model's projection and MLP matmuls (real weights, attention left out) in three
loop forms at several batch sizes and prints ms per pass and ratios to the scan:

* scan: `lax.scan` over the stacked weights (what the model does);
* switch: a `fori_loop` whose body picks the layer's weights with `lax.switch` over one
  branch per layer, each closing over that layer's own buffer (no copy; the attention,
  outside the branches, would stay compiled once);
* unrolled: a Python loop over the per-layer buffers (no copy, but every layer is
  compiled separately: with the attention inside, compile time would grow 30x);
* fused: the scan with q/k/v and gate/up concatenated into one weight each (two wider
  matmuls instead of five narrow ones).

    python scripts/bench_layer_loop.py --batch-sizes 1,16,32
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.roofline import median_seconds
from models.default_model import default_model_path
from models.loaders import load_model

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
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0]


def fused_layer(x, w):
    """`layer` with q|k|v and gate|up each one matmul."""
    nq, nkv = w["o"].shape[0], (w["qkv"].shape[1] - w["o"].shape[0]) // 2
    qkv = x @ w["qkv"]
    qkv = qkv[:, :nq] + jnp.pad(qkv[:, nq:nq + nkv] + qkv[:, nq + nkv:], ((0, 0), (0, nq - nkv)))
    x = x + qkv @ w["o"]
    gu = x @ w["gu"]
    n = gu.shape[1] // 2
    return x + (jax.nn.silu(gu[:, :n]) * gu[:, n:]) @ w["d"]


@jax.jit
def fused(stacked, x):
    return jax.lax.scan(lambda x, w: (fused_layer(x, w), None), x, stacked)[0]


@jax.jit
def switched(per_layer, x):
    branches = [lambda x, w=w: layer(x, w) for w in per_layer]
    return jax.lax.fori_loop(0, len(per_layer),
                             lambda i, x: jax.lax.switch(i, branches, x), x)


@jax.jit
def unrolled(per_layer, x):
    for w in per_layer:
        x = layer(x, w)
    return x


def layer_weights() -> tuple[dict, list[dict]]:
    """The default model's layer matmul weights: stacked {name: [L, in, out]} and per layer."""
    params = load_model(default_model_path(), "float32", "xla").params["layers"]
    stacked = {k: params[a][b]["kernel"] for k, (a, b) in NAMES.items()}  # [L, in, out]
    per_layer = jax.block_until_ready(
        [{k: jnp.array(w[i]) for k, w in stacked.items()}
         for i in range(stacked["q"].shape[0])])
    return stacked, per_layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,16,32")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    args = p.parse_args()
    stacked, per_layer = layer_weights()
    concat = {"qkv": jnp.concatenate([stacked[k] for k in "qkv"], -1), "o": stacked["o"],
              "gu": jnp.concatenate([stacked["g"], stacked["u"]], -1), "d": stacked["d"]}
    forms = {"scan": (scanned, stacked), "switch": (switched, per_layer),
             "unrolled": (unrolled, per_layer), "fused": (fused, concat)}
    hidden = stacked["q"].shape[1]
    x0 = jnp.ones((1, hidden), jnp.float32) * 0.01
    for name, (fn, w) in forms.items():
        t = time.perf_counter()
        text = fn.lower(w, x0).compile().as_text()
        print(f"{name}: compile {time.perf_counter() - t:.2f} s, "
              f"{text.count('dynamic-slice')} dynamic-slice ops in the optimized HLO")
    want = np.asarray(scanned(stacked, x0))
    for name in ("switch", "unrolled", "fused"):
        fn, w = forms[name]
        np.testing.assert_allclose(np.asarray(fn(w, x0)), want, rtol=1e-4, atol=1e-4)
    print()
    time_forms(forms, hidden, [int(s) for s in args.batch_sizes.split(",")], args.rounds,
               args.iters)


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


if __name__ == "__main__":
    main()

"""The `cpu` backend's layer matmuls: a C++ custom call over panel-packed, stacked weights.

`pack` lays a stacked weight f32[L, K, N] out as 16-column panels f32[L, P, K, 16]
(P = 3 ceil(N / 48): the kernel works in units of three panels, the columns past N
zero-padded) once at load time; `stacked_gemm(x,
panels, layer, n)` then multiplies by layer `layer` (traced inside the layer loop)
reading it in place: no per-layer copy of the weights out of the stack, as `nn.scan`
makes, and the panels spread over XLA's thread pool (`stacked_gemm.cc`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxserve_stacked_gemm_cpu"
PANEL = 16  # columns per panel (one AVX-512 vector, two AVX ones: a cache line per row)
UNIT = 3  # panels the kernel hands a thread at a time (48 columns)
SOURCE = os.path.join(os.path.dirname(__file__), "stacked_gemm.cc")


@functools.cache
def _registered() -> str | None:
    """Builds and registers the FFI target once per process; None, or why it failed."""
    from pallas_kernels.cpu_ffi.build import register

    return register(SOURCE, "StackedGemm", TARGET, "the CPU matmul kernel",
                    "layer matmuls use XLA's")


def available() -> bool:
    """Whether the kernel could be built and registered here (builds it on first call)."""
    return jax.default_backend() == "cpu" and _registered() is None


def num_panels(n: int, width: int = PANEL, unit: int = UNIT) -> int:
    """Panels of `width` columns holding `n` output columns: whole units of `unit`."""
    return -(-n // (width * unit)) * unit


def pack(w, width: int = PANEL, unit: int = UNIT, dtype=np.float32) -> jax.Array:
    """f32[L, K, N] stacked weights -> f32[L, 3 ceil(N / 48), K, 16] panels, zero-padded.

    `width` and `unit` lay out other panel widths (for benchmarks of other kernel
    versions): f32[L, unit ceil(N / (width unit)), K, width]; the kernel reads the defaults.
    `dtype` is the panels' (the quantized kernel's codes and scales, `qgemm.pack`).
    """
    w = np.asarray(w, dtype)
    if w.ndim != 3:
        raise ValueError(f"pack takes stacked weights [layers, in, out], got shape {w.shape}")
    num_layers, k, n = w.shape
    p = num_panels(n, width, unit)
    padded = np.zeros((num_layers, k, p * width), dtype)
    padded[:, :, :n] = w
    return jnp.asarray(np.ascontiguousarray(
        padded.reshape(num_layers, k, p, width).transpose(0, 2, 1, 3)))


def unpack(panels, n: int) -> jax.Array:
    """The inverse of `pack`: [L, K, n] from [L, P, K, 16], in the panels' dtype."""
    p = np.asarray(panels)
    num_layers, num_p, k, _ = p.shape
    return jnp.asarray(np.ascontiguousarray(
        p.transpose(0, 2, 1, 3).reshape(num_layers, k, num_p * PANEL)[:, :, :n]))


def call_panels(target: str, x: jax.Array, operands, layer, num_p: int, n: int,
                rows=None) -> jax.Array:
    """f32[M, n] from the FFI `target` over `operands` (packed panels, `num_p` of them) at
    layer `layer`: the kernel writes whole panels, the columns past `n` are cut off. With
    `rows` (i32[], traced) only x's first `rows` rows are multiplied, the rest of y is 0
    (a step's padding tokens)."""
    out = jax.ShapeDtypeStruct((x.shape[0], num_p * PANEL), jnp.float32)
    index = jnp.asarray(layer, jnp.int32)
    if rows is not None:  # i32[2]: the layer, then the rows (`RowsToCompute`, pool.h)
        index = jnp.stack([index.reshape(()), jnp.asarray(rows, jnp.int32).reshape(())])
    y = jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), *operands, index)
    return y if num_p * PANEL == n else y[:, :n]


def stacked_gemm(x: jax.Array, panels: jax.Array, layer, n: int, rows=None) -> jax.Array:
    """f32[M, n] = x f32[M, K] @ layer `layer` of `pack`ed weights (index clamped); with
    `rows`, only the first `rows` rows (the rest zero: `call_panels`).

    Raises:
        ValueError: `n` does not match the panels' width, or x's width is not K.
        RuntimeError: The kernel is unavailable here.
    """
    _, p, k, _ = panels.shape
    if num_panels(n) != p or x.shape[-1] != k:
        raise ValueError(f"stacked_gemm: x {x.shape} and {n} columns do not fit panels "
                         f"{panels.shape}")
    if not available():
        raise RuntimeError("the CPU matmul kernel is unavailable here")
    return call_panels(TARGET, x, (panels,), layer, p, n, rows)

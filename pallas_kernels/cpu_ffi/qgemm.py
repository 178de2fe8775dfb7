"""The `cpu` backend's layer matmuls over quantized weights: a C++ custom call reading
panel-packed q8/q4 codes in place and dequantizing them in registers (`stacked_qgemm.cc`).

`pack` lays a stacked quantized weight (the leaves of `models.quant`, each with a leading
layer axis: q8 {"qweight" i8[L, K, N], "scales" f16[L, K / B, N]}, q4 {"qweight"
u8[L, K / 2, N], "scales", "zeros" f16[L, K / 32, N]}) out as 16-column panels, every leaf
[L, P, rows, 16] (P = 3 ceil(N / 48), zero-padded: a padded column's scale is 0), once at
load time; `stacked_qgemm(x, panels, kind, layer, n)` multiplies by layer `layer` (traced
inside the layer loop) reading its codes in place: no float copy of the weight, in memory
or per layer.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

from pallas_kernels.cpu_ffi import gemm
from pallas_kernels.cpu_ffi.gemm import num_panels

TARGETS = {"q8": "jaxserve_stacked_q8_gemm_cpu", "q4": "jaxserve_stacked_q4_gemm_cpu"}
SYMBOLS = {"q8": "StackedQ8Gemm", "q4": "StackedQ4Gemm"}
LEAVES = {"q8": ("qweight", "scales"), "q4": ("qweight", "scales", "zeros")}
DTYPES = {"qweight": {"q8": np.int8, "q4": np.uint8}, "scales": np.float16,
          "zeros": np.float16}
SOURCE = os.path.join(os.path.dirname(__file__), "stacked_qgemm.cc")


@functools.cache
def _registered() -> str | None:
    """Builds the source and registers both FFI targets once per process; None, or why
    it failed."""
    from pallas_kernels.cpu_ffi.build import register

    for kind in ("q8", "q4"):
        error = register(SOURCE, SYMBOLS[kind], TARGETS[kind],
                         "the CPU quantized matmul kernel", "quantized matmuls use XLA's")
        if error:
            return error
    return None


def available() -> bool:
    """Whether the kernel could be built and registered here (builds it on first call)."""
    return jax.default_backend() == "cpu" and _registered() is None


def _check_kind(kind: str) -> None:
    if kind not in LEAVES:
        raise ValueError(f"unknown quantized format {kind!r}; expected 'q8' or 'q4'")


def pack(leaves: dict, kind: str) -> dict[str, jax.Array]:
    """Stacked quantized leaves [L, rows, N] -> panels [L, 3 ceil(N / 48), rows, 16] each.

    Raises:
        ValueError: Unknown `kind`, a missing or unstacked leaf, or leaves whose layers or
            columns differ.
    """
    _check_kind(kind)
    missing = [name for name in LEAVES[kind] if name not in leaves]
    if missing:
        raise ValueError(f"{kind} weight lacks leaves {missing} (has {sorted(leaves)})")
    arrays = {name: np.asarray(leaves[name]) for name in LEAVES[kind]}
    lead = {a.shape[0] for a in arrays.values() if a.ndim == 3}
    cols = {a.shape[-1] for a in arrays.values()}
    if any(a.ndim != 3 for a in arrays.values()) or len(lead) != 1 or len(cols) != 1:
        raise ValueError(f"pack takes stacked {kind} leaves [layers, rows, out], got "
                         f"{ {k: a.shape for k, a in arrays.items()} }")
    return {name: gemm.pack(a, dtype=DTYPES[name][kind] if name == "qweight" else DTYPES[name])
            for name, a in arrays.items()}


def unpack(panels: dict, n: int) -> dict[str, jax.Array]:
    """The inverse of `pack`: each leaf [L, rows, n] from [L, P, rows, 16]."""
    return {name: gemm.unpack(a, n) for name, a in panels.items()}


def supports(kind: str, k: int, block: int) -> bool:
    """Whether the kernel multiplies a `kind` weight with contraction size `k` and `block`
    values per scale (q4: blocks of 32; q8: any block dividing k)."""
    if kind == "q4":
        return block == 32 and k % 32 == 0
    return kind == "q8" and block > 0 and k % block == 0


def stacked_qgemm(x: jax.Array, panels: dict, kind: str, layer, n: int) -> jax.Array:
    """f32[M, n] = x f32[M, K] @ dequantized layer `layer` (index clamped) of `pack`ed
    `kind` leaves.

    Raises:
        ValueError: Unknown `kind`, leaves missing, `n` not the panels' width, or x's width
            not the weight's K.
        RuntimeError: The kernel is unavailable here.
    """
    _check_kind(kind)
    missing = [name for name in LEAVES[kind] if name not in panels]
    if missing:
        raise ValueError(f"stacked_qgemm: {kind} panels lack {missing}")
    _, p, rows, _ = panels["qweight"].shape
    k = rows * (2 if kind == "q4" else 1)
    if num_panels(n) != p or x.shape[-1] != k:
        raise ValueError(f"stacked_qgemm: x {x.shape} and {n} columns do not fit {kind} "
                         f"panels {panels['qweight'].shape}")
    if not available():
        raise RuntimeError("the CPU quantized matmul kernel is unavailable here")
    return gemm.call_panels(TARGETS[kind], x, [panels[name] for name in LEAVES[kind]], layer,
                            p, n)

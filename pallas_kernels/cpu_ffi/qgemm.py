"""The `cpu` backend's layer matmuls over quantized weights: a C++ custom call reading
panel-packed q8/q4/FP8/FP4 codes in place and dequantizing them in registers
(`stacked_qgemm.cc`).

`pack` lays a stacked quantized weight (the leaves of `models.quant`, each with a leading
layer axis: q8 {"qweight" i8[L, K, N], "scales" f16[L, K / B, N]}, q4 {"qweight"
u8[L, K / 2, N], "scales" f16 and "zeros" f16 or f32 [L, K / G, N], G a multiple of 32},
fp8 {"qweight" float8_e4m3fn[L, K, N], "block_scales" f32[L, K / B, N]: one scale per
column, `models.linear.panels` widens a checkpoint's column blocks}, mxfp4 {"qweight"
u8[L, K / 2, N] (`models.quant`'s FP4 pairs, moved into q4's: `fp4_to_q4_order`),
"e8m0_scales" u8[L, K / 32, N]}, nvfp4 {"qweight", "e4m3_scales" float8_e4m3fn[L, K / 16, N],
"global_scale" f32[L, 1, 1], kept as it is}) out as 16-column panels, every leaf
[L, P, rows, 16] (P = 3 ceil(N / 48), zero-padded: a padded column's scale is 0), once at
load time; `stacked_qgemm(x, panels, kind, layer, n)` multiplies by layer `layer` (traced
inside the layer loop) reading its codes in place: no float copy of the weight, in memory
or per layer.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.cpu_ffi import gemm
from pallas_kernels.cpu_ffi.gemm import num_panels

# The q8 target reads FP8 codes too, the fp4 one MXFP4's and NVFP4's (their dtypes tell
# them apart).
TARGETS = {"q8": "jaxserve_stacked_q8_gemm_cpu", "q4": "jaxserve_stacked_q4_gemm_cpu",
           "fp8": "jaxserve_stacked_q8_gemm_cpu", "mxfp4": "jaxserve_stacked_fp4_gemm_cpu",
           "nvfp4": "jaxserve_stacked_fp4_gemm_cpu"}
SYMBOLS = {"q8": "StackedQ8Gemm", "q4": "StackedQ4Gemm", "mxfp4": "StackedFp4Gemm"}
LEAVES = {"q8": ("qweight", "scales"), "q4": ("qweight", "scales", "zeros"),
          "fp8": ("qweight", "block_scales"), "mxfp4": ("qweight", "e8m0_scales"),
          "nvfp4": ("qweight", "e4m3_scales", "global_scale")}
DTYPES = {"q8": {"qweight": np.int8, "scales": np.float16},
          "q4": {"qweight": np.uint8, "scales": np.float16},  # zeros: f16 or f32, kept
          "fp8": {"qweight": ml_dtypes.float8_e4m3fn, "block_scales": np.float32},
          "mxfp4": {"qweight": np.uint8, "e8m0_scales": np.uint8},
          "nvfp4": {"qweight": np.uint8, "e4m3_scales": ml_dtypes.float8_e4m3fn}}
# Kinds whose codes are two 4-bit values a byte, in q4's panel order (`_dot_order`).
NIBBLES = ("q4", "mxfp4", "nvfp4")
FP4_BLOCKS = {"mxfp4": 32, "nvfp4": 16}
SOURCE = os.path.join(os.path.dirname(__file__), "stacked_qgemm.cc")
# Rows from which a call dequantizes each unit to float32 once (exact float products); below
# it q4 activations are split into two int8 parts for `maddubs` (~15 bits: `DotTile`).
# The kernel's kStageRows.
STAGE_ROWS = 12


@functools.cache
def _registered() -> str | None:
    """Builds the source and registers both FFI targets once per process; None, or why
    it failed."""
    from pallas_kernels.cpu_ffi.build import register

    for kind in SYMBOLS:
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
        raise ValueError(f"unknown quantized format {kind!r}; expected one of "
                         f"{', '.join(LEAVES)}")


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
    glob = arrays.pop("global_scale", None)  # NVFP4's f32[L, 1, 1]: kept as it is
    lead = {a.shape[0] for a in arrays.values() if a.ndim == 3}
    cols = {a.shape[-1] for a in arrays.values()}
    if any(a.ndim != 3 for a in arrays.values()) or len(lead) != 1 or len(cols) != 1:
        raise ValueError(f"pack takes stacked {kind} leaves [layers, rows, out], got "
                         f"{ {k: a.shape for k, a in arrays.items()} }")
    if kind == "q4" and arrays["zeros"].dtype != np.float32:
        arrays["zeros"] = arrays["zeros"].astype(np.float16)
    if glob is not None and glob.shape != (next(iter(lead)), 1, 1):
        raise ValueError(f"nvfp4 global_scale {glob.shape} must be [layers, 1, 1]")
    if kind in FP4_BLOCKS:  # value pairs (2r, 2r + 1) -> q4's (32 b + j, 32 b + 16 + j)
        arrays["qweight"] = fp4_to_q4_order(arrays["qweight"])
    out = {name: gemm.pack(a, dtype=DTYPES[kind].get(name, a.dtype))
           for name, a in arrays.items()}
    if kind in NIBBLES:
        out["qweight"] = jnp.asarray(_dot_order(np.asarray(out["qweight"])))
    if glob is not None:
        out["global_scale"] = jnp.asarray(glob, jnp.float32)
    return out


def unpack(panels: dict, n: int, kind: str) -> dict[str, jax.Array]:
    """The inverse of `pack`: each leaf [L, rows, n] from [L, P, rows, 16] (NVFP4's
    global scale as it is)."""
    _check_kind(kind)
    panels = dict(panels)
    glob = panels.pop("global_scale", None)
    if kind in NIBBLES:
        panels["qweight"] = _dot_order(np.asarray(panels["qweight"]), inverse=True)
    out = {name: gemm.unpack(a, n) for name, a in panels.items()}
    if kind in FP4_BLOCKS:
        out["qweight"] = jnp.asarray(fp4_to_q4_order(np.asarray(out["qweight"]), inverse=True))
    return out if glob is None else {**out, "global_scale": glob}


def supports(kind: str, k: int, block: int) -> bool:
    """Whether the kernel multiplies a `kind` weight with contraction size `k` and `block`
    values per scale along k (q4: a multiple of 32 dividing k; q8, fp8: any block dividing
    k; mxfp4 and nvfp4: their blocks of 32 and 16, k a multiple of 32)."""
    if kind in FP4_BLOCKS:
        return block == FP4_BLOCKS[kind] and k % 32 == 0
    if kind == "q4":
        return block > 0 and block % 32 == 0 and k % block == 0
    return kind in ("q8", "fp8") and block > 0 and k % block == 0


def stacked_qgemm(x: jax.Array, panels: dict, kind: str, layer, n: int,
                  rows=None) -> jax.Array:
    """f32[M, n] = x f32[M, K] @ dequantized layer `layer` (index clamped) of `pack`ed
    `kind` leaves; with `rows`, only the first `rows` rows (the rest zero:
    `gemm.call_panels`).

    Raises:
        ValueError: Unknown `kind`, leaves missing, `n` not the panels' width, or x's width
            not the weight's K.
        RuntimeError: The kernel is unavailable here.
    """
    _check_kind(kind)
    missing = [name for name in LEAVES[kind] if name not in panels]
    if missing:
        raise ValueError(f"stacked_qgemm: {kind} panels lack {missing}")
    _, p, code_rows, _ = panels["qweight"].shape
    k = code_rows * (2 if kind in NIBBLES else 1)
    if num_panels(n) != p or x.shape[-1] != k:
        raise ValueError(f"stacked_qgemm: x {x.shape} and {n} columns do not fit {kind} "
                         f"panels {panels['qweight'].shape}")
    if not available():
        raise RuntimeError("the CPU quantized matmul kernel is unavailable here")
    operands = [panels[name] for name in LEAVES[kind]]
    if kind == "mxfp4":  # the fp4 target's global scale: one per layer
        operands.append(jnp.ones((panels["qweight"].shape[0], 1, 1), jnp.float32))
    return gemm.call_panels(TARGETS[kind], x, operands, layer, p, n, rows)


def columns(panels: dict, ids: jax.Array) -> dict[str, jax.Array]:
    """The leaves of columns `ids` i32[T] of layer 0 of `pack`ed panels, in
    `models.quant`'s layout ([rows, T] each): an embedding lookup in a tied LM head's
    panels."""
    out = {name: leaf[0, ids // gemm.PANEL, :, ids % gemm.PANEL].T
           for name, leaf in panels.items()}
    if "zeros" in panels:  # q4: each block's 16 rows of a column, from the kernel's order
        codes = panels["qweight"][0]  # u8[P, K / 2, 16]
        nb = codes.shape[1] // 16
        col = ids % gemm.PANEL
        rows = (16 * jnp.arange(nb)[None, :, None]
                + jnp.asarray(_DOT_ROW)[col][:, None, :])  # i32[T, nb, 16]
        picked = codes[(ids // gemm.PANEL)[:, None, None], rows,
                       jnp.asarray(_DOT_COL)[col][:, None, :]]  # u8[T, nb, 16]
        out["qweight"] = picked.reshape(ids.shape[0], nb * 16).T
    return out


def fp4_to_q4_order(codes: np.ndarray, inverse: bool = False) -> np.ndarray:
    """FP4 codes u8[L, K / 2, N] with row r holding values 2r (low nibble) and 2r + 1
    (`models.quant`'s ``mxfp4``/``nvfp4``) in q4's order (row 16 b + j holding values
    32 b + j and 32 b + 16 + j), or back (`inverse`). K a multiple of 32."""
    num_layers, half, n = codes.shape
    values = np.stack([codes & 15, codes >> 4], axis=2)  # u8[L, K / 2, 2, N]
    if inverse:  # q4 -> pairs: [L, nb, 16 (j), 2 (half), N] -> values [L, K, N]
        values = values.reshape(num_layers, half // 16, 16, 2, n).transpose(0, 1, 3, 2, 4)
        pairs = values.reshape(num_layers, half, 2, n)
    else:  # pairs -> q4: values [L, nb, 2 (half), 16 (j), N]
        values = values.reshape(num_layers, half // 16, 2, 16, n).transpose(0, 1, 3, 2, 4)
        pairs = values.reshape(num_layers, half, 2, n)
    return np.ascontiguousarray(pairs[:, :, 0] | (pairs[:, :, 1] << 4)).astype(np.uint8)


# A q4 panel's block (16 packed rows x 16 columns: row t holds values t and 16 + t of the
# block, `models.quant`) reordered for the kernel's int8 dot products: axes (4 groups, 4
# values, 2 column groups, 8 columns) -> (column groups, groups, columns, values), so 32
# bytes hold 8 columns x 4 consecutive values (`stacked_qgemm.cc`, `DotTile`).
_Q4_BLOCK = (4, 4, 2, 8)
_DOT_BLOCK = (2, 4, 8, 4)
Q4_TO_DOT = (0, 1, 2, 5, 3, 6, 4)
DOT_TO_Q4 = (0, 1, 2, 4, 6, 3, 5)


def _dot_order(codes: np.ndarray, inverse: bool = False) -> np.ndarray:
    """u8[L, P, K / 2, 16] q4 panels in the kernel's order (or back, `inverse`)."""
    num_layers, num_p, rows, _ = codes.shape
    blocks = codes.reshape(num_layers, num_p, rows // 16, *(_DOT_BLOCK if inverse else _Q4_BLOCK))
    order = DOT_TO_Q4 if inverse else Q4_TO_DOT
    return np.ascontiguousarray(blocks.transpose(order)).reshape(codes.shape)


def _dot_offsets() -> tuple[np.ndarray, np.ndarray]:
    """(row, column) in the kernel's order of packed row t (16) of panel column c (16)
    of a q4 block: i32[16, 16] each, read off `_dot_order` of the block's own indices."""
    moved = _dot_order(np.arange(256, dtype=np.int32).reshape(1, 1, 16, 16)).reshape(256)
    where = np.empty(256, np.int32)
    where[moved] = np.arange(256, dtype=np.int32)  # model-order index -> kernel position
    where = where.reshape(16, 16).T  # [c, t]
    return where // 16, where % 16


_DOT_ROW, _DOT_COL = _dot_offsets()

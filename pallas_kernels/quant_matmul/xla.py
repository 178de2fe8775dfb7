"""Quantized matmul in plain XLA, written so the dequantized weight is fused into the dot.

q8: the weight is dequantized in the compute dtype and multiplied; XLA's CPU backend fuses
the convert and scale into the dot's operand (measured: batch-1 projection of SmolLM2 2.4x
faster than its float32 weights). q4: unpacking nibbles into one [K, N] array (a concat
across the block axis) was 3x slower than float32 here, so the low and high nibbles stay
two [K / 2, N] operands and x is split to match: y = x_lo @ w_lo + x_hi @ w_hi, which never
interleaves anything.
"""

from __future__ import annotations

import jax

from pallas_kernels.quant_matmul.reference import Q4_HALF, check_quant_weight


def quant_matmul_xla(x: jax.Array, w: dict, kind: str) -> jax.Array:
    """x [M, K] @ dequantized w [K, N] -> [M, N] in x's dtype (see the module docstring)."""
    k, n = check_quant_weight(w, kind)
    if x.shape[-1] != k:
        raise ValueError(f"x {x.shape} does not match the weight's input size {k}")
    dtype = x.dtype
    scales = w["scales"].astype(dtype)
    nb = scales.shape[0]
    if kind == "q8":
        wq = w["qweight"].astype(dtype).reshape(nb, k // nb, n) * scales[:, None, :]
        return x @ wq.reshape(k, n)
    # A block of B = k / nb values (a multiple of 32) is B / 32 packed sub-blocks of 16 rows.
    p = w["qweight"].reshape(nb, k // nb // 32 * Q4_HALF, n)  # u8[nb, B / 2, N]
    s, z = scales[:, None, :], w["zeros"].astype(dtype)[:, None, :]
    w_lo = ((p & 15).astype(dtype) * s + z).reshape(k // 2, n)
    w_hi = ((p >> 4).astype(dtype) * s + z).reshape(k // 2, n)
    xb = x.reshape(*x.shape[:-1], k // 32, 2, Q4_HALF)
    x_lo = xb[..., 0, :].reshape(*x.shape[:-1], k // 2)
    x_hi = xb[..., 1, :].reshape(*x.shape[:-1], k // 2)
    return x_lo @ w_lo + x_hi @ w_hi

"""Pure-jnp FP4 block-scaled matmul: decode the codes through the 16-entry E2M1 table, scale
each block, two dots (the oracle of the Pallas kernel, and the XLA path every backend
without it serves with).

A weight arrives as the leaves of one ``mxfp4`` or ``nvfp4`` module (`models.quant`):
``qweight`` u8[..., K / 2, N], code row r holding value 2r in its low nibble and 2r + 1 in
its high one, and the block scales along K: ``e8m0_scales`` u8[..., K / 32, N] (MXFP4: the
exponent of a power of two, bias 127) or ``e4m3_scales`` float8_e4m3fn[..., K / 16, N] with
``global_scale`` f32[..., 1, 1] (NVFP4). The value at (k, n) is
``fp4(k, n) * scale[k // block, n]`` (times the global scale).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# E2M1 by code: sign (bit 3), exponent (bits 1-2), mantissa (bit 0).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_BLOCKS = {"mxfp4": 32, "nvfp4": 16}
SCALE_LEAF = {"mxfp4": "e8m0_scales", "nvfp4": "e4m3_scales"}
# E8M0 by byte: 2^(e - 127); 0xFF is NaN.
E8M0_VALUES = np.where(np.arange(256) == 255, np.nan,
                       np.ldexp(1.0, np.arange(256) - 127)).astype(np.float32)


def check_fp4_weight(w: dict, kind: str) -> tuple[int, int]:
    """(K, N) of an FP4 weight; ValueError naming the leaf whose shape or dtype is wrong.

    Args:
        w: The leaves ({"qweight", the kind's scales[, "global_scale"]}).
        kind: "mxfp4" or "nvfp4".
    """
    if kind not in FP4_BLOCKS:
        raise ValueError(f"unknown FP4 kind {kind!r} (supported: {', '.join(FP4_BLOCKS)})")
    q, scales = w["qweight"], w[SCALE_LEAF[kind]]
    half, n = q.shape[-2:]
    k, block = 2 * half, FP4_BLOCKS[kind]
    if q.dtype != jnp.uint8 or k % block:
        raise ValueError(f"qweight {q.dtype}{list(q.shape)} must be uint8 codes [..., K / 2, N] "
                         f"with K a multiple of {kind}'s block of {block}")
    if tuple(scales.shape) != (*q.shape[:-2], k // block, n):
        raise ValueError(f"{SCALE_LEAF[kind]} {scales.shape} do not fit qweight {q.shape}: "
                         f"want [..., {k // block}, {n}]")
    if kind == "nvfp4" and tuple(w["global_scale"].shape) != (*q.shape[:-2], 1, 1):
        raise ValueError(f"global_scale {w['global_scale'].shape} must be [..., 1, 1] "
                         f"beside qweight {q.shape}")
    return k, n


def block_scales(w: dict, kind: str) -> jax.Array:
    """The scales as f32[..., K / block, N] (NVFP4's times its global scale)."""
    scales = w[SCALE_LEAF[kind]]
    if kind == "mxfp4":
        return jnp.take(jnp.asarray(E8M0_VALUES), scales.astype(jnp.int32))
    return scales.astype(jnp.float32) * w["global_scale"].astype(jnp.float32)


def decode_pairs(codes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32 values of the low and high nibbles of codes u8[..., R, N] (K's even and odd
    values), each [..., R, N]."""
    table = jnp.asarray(FP4_VALUES, jnp.float32)
    return jnp.take(table, codes & 15), jnp.take(table, codes >> 4)


def _halves(w: dict, kind: str) -> tuple[jax.Array, jax.Array]:
    """The dequantized even and odd rows of K, f32[..., K / 2, N] each."""
    check_fp4_weight(w, kind)
    per_row = jnp.repeat(block_scales(w, kind), FP4_BLOCKS[kind] // 2, axis=-2)
    lo, hi = decode_pairs(w["qweight"])
    return lo * per_row, hi * per_row


def dequantize_fp4(w: dict, kind: str, dtype=jnp.float32) -> jax.Array:
    """The dense weight dtype[..., K, N] of an FP4 module (float32 products, then cast)."""
    even, odd = _halves(w, kind)
    dense = jnp.stack([even, odd], axis=-2)  # [..., K / 2, 2, N]
    return dense.reshape(*even.shape[:-2], -1, even.shape[-1]).astype(dtype)


def fp4_matmul_reference(x: jax.Array, w: dict, kind: str) -> jax.Array:
    """x [..., K] @ the dequantized weight [K, N], in x's dtype.

    K's even and odd values are the codes' low and high nibbles: x's even and odd columns
    multiply each half (no interleaved copy of the weight). The codes are decoded inside
    the step; XLA fuses the decode and the scaling into each dot's operand.
    """
    even, odd = (h.astype(x.dtype) for h in _halves(w, kind))
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return (jax.lax.dot_general(x[..., 0::2], even, dims)
            + jax.lax.dot_general(x[..., 1::2], odd, dims))

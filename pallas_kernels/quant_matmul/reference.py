"""Pure-jnp quantized matmul: dequantize the whole weight, then one dot (the kernels' oracle).

Weights arrive as the leaves of one quantized module in the on-device layout of
`models.quant`: ``qweight`` (i8[K, N] for q8, u8[K // 2, N] for q4), ``scales``
f16[K // block, N] and, for q4, ``zeros`` [K // block, N] (f16, or f32 where a checkpoint's
zero points need it). A q4 block is any multiple of 32 values (its codes are packed in
32-value sub-blocks either way); q8 blocks are any divisor of K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Q4_HALF = 16  # values per nibble half of a 32-value q4 block


def check_quant_weight(w: dict, kind: str) -> tuple[int, int]:
    """(K, N) of a quantized weight; ValueError naming the leaf whose shape is wrong."""
    if kind not in ("q8", "q4"):
        raise ValueError(f"unknown quantized format {kind!r}; expected 'q8' or 'q4'")
    q, scales = w["qweight"], w["scales"]
    k = q.shape[0] * (2 if kind == "q4" else 1)
    n = q.shape[1]
    if scales.ndim != 2 or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"scales {scales.shape} do not fit qweight {q.shape} ({kind})")
    if kind == "q4":
        if k % 32 or (k // scales.shape[0]) % 32:
            raise ValueError(f"q4 qweight {q.shape} needs blocks of a multiple of 32 values; "
                             f"scales {scales.shape} give blocks of {k // scales.shape[0]}")
        if w["zeros"].shape != scales.shape:
            raise ValueError(f"zeros {w['zeros'].shape} differ from scales {scales.shape}")
    return k, n


def dequantize(w: dict, kind: str, dtype=jnp.float32) -> jax.Array:
    """The dense weight dtype[K, N] of a quantized module."""
    k, n = check_quant_weight(w, kind)
    scales = w["scales"].astype(jnp.float32)
    nb = scales.shape[0]
    if kind == "q8":
        q = w["qweight"].astype(jnp.float32).reshape(nb, k // nb, n)
        return (q * scales[:, None, :]).reshape(k, n).astype(dtype)
    p = w["qweight"].reshape(k // 32, 1, Q4_HALF, n)
    q = jnp.concatenate([p & 15, p >> 4], axis=1).astype(jnp.float32).reshape(nb, k // nb, n)
    deq = q * scales[:, None, :] + w["zeros"].astype(jnp.float32)[:, None, :]
    return deq.reshape(k, n).astype(dtype)


def quant_matmul_reference(x: jax.Array, w: dict, kind: str) -> jax.Array:
    """x [M, K] @ dequantize(w) [K, N] in float32, returned in x's dtype."""
    return (x.astype(jnp.float32) @ dequantize(w, kind)).astype(x.dtype)


def int8_activations(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x f32[M, K] split per block of `block` values as the CPU q4 kernel does
    (`pallas_kernels/cpu_ffi/stacked_qgemm.cc`): x ~ d (xq + xr / 254) with codes xq and
    xr f32[M, K] holding integers in [-127, 127] (round half to even): xq of x scaled by
    127 / max |x|, xr of what that rounding left, scaled by 254; and d f32[M, K / block],
    max |x| / 127."""
    m, k = x.shape
    xb = x.astype(jnp.float32).reshape(m, k // block, block)
    amax = jnp.max(jnp.abs(xb), axis=-1)  # f32[M, K / block]
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    scaled = xb * inv[..., None]
    whole = jnp.round(scaled)
    rest = jnp.round((scaled - whole) * 254.0)
    return whole.reshape(m, k), rest.reshape(m, k), amax / 127.0


def q4_int8_matmul_reference(x: jax.Array, w: dict) -> jax.Array:
    """x f32[M, K] @ a q4 weight as the CPU q4 kernel computes it, x split into int8 parts
    per 32-value block (`int8_activations`): per block, its group's scale x d x (the
    integer dots of the codes with xq, plus with xr over 254), plus its group's zero x the
    block's (unsplit) sum of x."""
    k, n = check_quant_weight(w, "q4")
    m, nb = x.shape[0], k // 32
    xq, xr, xd = int8_activations(x)
    p = w["qweight"].reshape(nb, 1, Q4_HALF, n)
    q = jnp.concatenate([p & 15, p >> 4], axis=1).astype(jnp.float32).reshape(nb, 32, n)
    dot = lambda a: jnp.einsum("mbk,bkn->mbn", a.reshape(m, nb, 32), q,
                               precision="highest")  # integers: exact in float32
    dots = dot(xq) + dot(xr) / 254.0  # f32[M, nb, n]
    xsum = x.astype(jnp.float32).reshape(m, nb, 32).sum(-1)  # f32[M, nb]
    # One scale and zero per group of a multiple of 32: repeated over its 32-value blocks.
    scales, zeros = (jnp.repeat(w[name].astype(jnp.float32), nb // w[name].shape[0], axis=0)
                     for name in ("scales", "zeros"))  # f32[nb, N]
    return (jnp.einsum("mbn,bn->mn", dots * xd[..., None], scales, precision="highest")
            + jnp.einsum("mb,bn->mn", xsum, zeros, precision="highest"))


def quant_embed(w: dict, kind: str, ids: jax.Array, dtype) -> jax.Array:
    """Embedding rows dtype[T, K] of token `ids` from a quantized [K, vocab] table.

    Gathers only the `ids` columns (their codes and scales), then dequantizes those.
    """
    cols = {name: jnp.take(leaf, ids, axis=1) for name, leaf in w.items()}
    return dequantize(cols, kind, dtype).T

"""Pure-jnp FP8 block-scaled matmul: widen the codes, scale each block, one dot (the oracle
of the Pallas kernel, and the XLA path every backend without it serves with).

A weight arrives as the leaves of one ``fp8`` module (`models.quant`): ``qweight``
float8_e4m3fn[..., K, N] and ``block_scales`` f32[..., ceil(K / bk), ceil(N / bn)]; the
value at (k, n) is ``qweight[k, n] * block_scales[k // bk, n // bn]``, the last block along
an axis cut short where the block does not divide it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_fp8_weight(w: dict, block: tuple[int, int]) -> tuple[int, int]:
    """(K, N) of an FP8 weight; ValueError naming the leaf whose shape is wrong.

    Args:
        w: The leaves ({"qweight", "block_scales"}).
        block: (bk, bn), each already resolved (no 0).
    """
    q, scales = w["qweight"], w["block_scales"]
    k, n = q.shape[-2:]
    bk, bn = block
    want = (-(-k // bk), -(-n // bn))
    if tuple(scales.shape[-2:]) != want or scales.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"block_scales {scales.shape} do not fit qweight {q.shape} in "
                         f"blocks of {bk}x{bn}: want [..., {want[0]}, {want[1]}]")
    return k, n


def expand_scales(scales: jax.Array, k: int, n: int, block: tuple[int, int],
                  axis: str = "both") -> jax.Array:
    """Block scales [..., Kb, Nb] repeated to one per value: [..., K, N] ("both") or one
    per row of blocks and column, [..., Kb, N] ("n", what the Pallas kernel reads)."""
    bk, bn = block
    out = jnp.repeat(scales, bn, axis=-1)[..., :n]
    if axis == "both":
        out = jnp.repeat(out, bk, axis=-2)[..., :k, :]
    return out


def dequantize_fp8(w: dict, block: tuple[int, int], dtype=jnp.float32) -> jax.Array:
    """The dense weight dtype[..., K, N] of an FP8 module (float32 products, then cast)."""
    k, n = check_fp8_weight(w, block)
    scales = expand_scales(w["block_scales"].astype(jnp.float32), k, n, block)
    return (w["qweight"].astype(jnp.float32) * scales).astype(dtype)


def fp8_matmul_reference(x: jax.Array, w: dict, block: tuple[int, int]) -> jax.Array:
    """x [..., K] @ the dequantized weight [K, N], in x's dtype.

    The codes are widened to x's dtype inside the step (XLA fuses the widening and the
    scaling into the operand of the dot); no dequantized copy outlives the step.
    """
    k, n = check_fp8_weight(w, block)
    scales = expand_scales(w["block_scales"].astype(x.dtype), k, n, block)
    weight = w["qweight"].astype(x.dtype) * scales
    return jax.lax.dot_general(x, weight, (((x.ndim - 1,), (0,)), ((), ())))

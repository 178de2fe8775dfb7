"""Quantized matmul as a Pallas kernel: the weight is dequantized one 32-row block at a time.

A scale may cover several 32-row blocks (GPTQ/AWQ groups of 64 or 128, or a whole
column): each block reads its group's scale and zero.

Grid: (row tiles of x, column tiles of the weight). Each program walks K in blocks of 32
values: it loads the block's codes, converts them, applies the block's scale (and zero),
and accumulates a dot in float32. For q4 a block is two dots of 16: the low nibbles hold
values 0..15 of the block and the high nibbles 16..31, so nothing is interleaved or
reshaped inside the kernel. Per-channel q8 (one scale per column) scales the sum once.

NOTE: generic Pallas (BlockSpecs, refs, `pl.ds`): the CPU runs it with `interpret=True`,
the GPU lowers it through Triton (dots of 16+ along each axis), TPU through Mosaic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.quant_matmul.reference import Q4_HALF, check_quant_weight

BLOCK_K = 32


def _q8_kernel(x_ref, q_ref, s_ref, o_ref, *, num_blocks: int, per_channel: bool,
               per_scale: int):
    def body(b, acc):
        xs = x_ref[:, pl.ds(b * BLOCK_K, BLOCK_K)].astype(jnp.float32)
        ws = q_ref[pl.ds(b * BLOCK_K, BLOCK_K), :].astype(jnp.float32)
        part = jnp.dot(xs, ws, preferred_element_type=jnp.float32)
        if per_channel:
            return acc + part
        return acc + part * s_ref[pl.ds(b // per_scale, 1), :].astype(jnp.float32)

    acc = lax.fori_loop(0, num_blocks, body, jnp.zeros(o_ref.shape, jnp.float32))
    if per_channel:
        acc = acc * s_ref[pl.ds(0, 1), :].astype(jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


def _q4_kernel(x_ref, q_ref, s_ref, z_ref, o_ref, *, num_blocks: int, per_scale: int):
    # `per_scale` 32-value sub-blocks share a scale and zero (a q4 block of 32 * per_scale).
    def body(b, acc):
        p = q_ref[pl.ds(b * Q4_HALF, Q4_HALF), :]  # u8[16, bn]
        s = s_ref[pl.ds(b // per_scale, 1), :].astype(jnp.float32)
        z = z_ref[pl.ds(b // per_scale, 1), :].astype(jnp.float32)
        w_lo = (p & 15).astype(jnp.float32) * s + z
        w_hi = (p >> 4).astype(jnp.float32) * s + z
        x_lo = x_ref[:, pl.ds(b * BLOCK_K, Q4_HALF)].astype(jnp.float32)
        x_hi = x_ref[:, pl.ds(b * BLOCK_K + Q4_HALF, Q4_HALF)].astype(jnp.float32)
        return (acc + jnp.dot(x_lo, w_lo, preferred_element_type=jnp.float32)
                + jnp.dot(x_hi, w_hi, preferred_element_type=jnp.float32))

    acc = lax.fori_loop(0, num_blocks, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile(n: int) -> int:
    return next((t for t in (128, 64, 32, 16) if n % t == 0), n)


@functools.partial(jax.jit, static_argnames=("kind", "block_m", "interpret"))
def quant_matmul_kernel(x: jax.Array, w: dict, kind: str, *, block_m: int = 16,
                        interpret: bool = False) -> jax.Array:
    """x [M, K] @ dequantized w [K, N] -> [M, N] in x's dtype.

    Args:
        x: Activations (rows are padded to a multiple of `block_m` internally).
        w: Quantized leaves (see `pallas_kernels.quant_matmul.reference`).
        kind: "q8" or "q4".
        block_m: Rows of x per program.
        interpret: Run in the Pallas interpreter (the CPU).

    Raises:
        ValueError: K, or the block (K / scale rows), is not a multiple of 32.
    """
    k, n = check_quant_weight(w, kind)
    m = x.shape[0]
    if x.shape != (m, k):
        raise ValueError(f"x {x.shape} must be [M, {k}] for the weight")
    if k % BLOCK_K:
        raise ValueError(f"the kernel needs K ({k}) to be a multiple of {BLOCK_K}")
    nb = w["scales"].shape[0]
    if (k // nb) % BLOCK_K:
        raise ValueError(f"the kernel supports blocks of a multiple of {BLOCK_K} values; "
                         f"got blocks of {k // nb}")
    padded = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, padded - m), (0, 0)))
    bn = _tile(n)
    grid = (padded // block_m, n // bn)
    x_spec = pl.BlockSpec((block_m, k), lambda i, j: (i, 0))
    col = lambda rows: pl.BlockSpec((rows, bn), lambda i, j: (0, j))
    out_spec = pl.BlockSpec((block_m, bn), lambda i, j: (i, j))
    out_shape = jax.ShapeDtypeStruct((padded, n), x.dtype)
    if kind == "q8":
        body = functools.partial(_q8_kernel, num_blocks=k // BLOCK_K, per_channel=nb == 1,
                                 per_scale=k // nb // BLOCK_K)
        out = pl.pallas_call(body, grid=grid, in_specs=[x_spec, col(k), col(nb)],
                             out_specs=out_spec, out_shape=out_shape, interpret=interpret)(
            xp, w["qweight"], w["scales"])
    else:
        body = functools.partial(_q4_kernel, num_blocks=k // BLOCK_K,
                                 per_scale=k // nb // BLOCK_K)
        out = pl.pallas_call(body, grid=grid, in_specs=[x_spec, col(k // 2), col(nb), col(nb)],
                             out_specs=out_spec, out_shape=out_shape, interpret=interpret)(
            xp, w["qweight"], w["scales"], w["zeros"])
    return out[:m]

"""FP8 block-scaled matmul as a Pallas kernel: the weight is widened one K-block at a time.

Grid: (row tiles of x, column tiles of the weight). Each program walks K in blocks of bk
values (the checkpoint's block along K; a shorter last block where bk does not divide K):
it loads the block's FP8 codes, widens them to float32, multiplies them by the block's
scales (expanded along N outside the kernel to one per column: [Kb, N], 1/bk of the codes'
count) and accumulates the dot in float32. Nothing is dequantized outside the tile.

NOTE: generic Pallas (BlockSpecs, refs, `pl.ds`): the CPU runs it with `interpret=True`,
the GPU lowers it through Triton, TPU through Mosaic. A native FP8 dot (Hopper's, with the
activations quantized per token) would change the numbers; this kernel keeps the
activations in their float dtype, as the dequantized model computes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp8_matmul.reference import check_fp8_weight, expand_scales


def _fp8_kernel(x_ref, q_ref, s_ref, o_ref, *, k: int, bk: int):
    def block(start: int | jax.Array, size: int, b) -> jax.Array:
        xs = x_ref[:, pl.ds(start, size)].astype(jnp.float32)
        ws = q_ref[pl.ds(start, size), :].astype(jnp.float32) * s_ref[pl.ds(b, 1), :]
        return jnp.dot(xs, ws, preferred_element_type=jnp.float32)

    full = k // bk
    acc = lax.fori_loop(0, full, lambda b, acc: acc + block(b * bk, bk, b),
                        jnp.zeros(o_ref.shape, jnp.float32))
    if k % bk:  # the last block, cut short (static size)
        acc = acc + block(full * bk, k % bk, full)
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile(n: int) -> int:
    return next((t for t in (128, 64, 32, 16) if n % t == 0), n)


@functools.partial(jax.jit, static_argnames=("block", "block_m", "interpret", "target"))
def fp8_matmul_kernel(x: jax.Array, w: dict, block: tuple[int, int], *, block_m: int = 16,
                      interpret: bool = False, target: str | None = None) -> jax.Array:
    """x [M, K] @ the dequantized FP8 weight [K, N] -> [M, N] in x's dtype.

    Args:
        x: Activations (rows are padded to a multiple of `block_m` internally).
        w: FP8 leaves (`pallas_kernels.fp8_matmul.reference`).
        block: (bk, bn), resolved.
        block_m: Rows of x per program.
        interpret: Run in the Pallas interpreter (the CPU).
        target: The platform lowered for ("gpu": Triton, "tpu": Mosaic); None: JAX's
            default backend.

    Raises:
        ValueError: Leaves that do not fit each other or x.
    """
    k, n = check_fp8_weight(w, block)
    m = x.shape[0]
    if x.shape != (m, k):
        raise ValueError(f"x {x.shape} must be [M, {k}] for the weight")
    scales = expand_scales(w["block_scales"].astype(jnp.float32), k, n, block, axis="n")
    kb = scales.shape[0]
    padded = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, padded - m), (0, 0)))
    tn = _tile(n)
    col = lambda rows: pl.BlockSpec((rows, tn), lambda i, j: (0, j))
    out = pl.pallas_call(
        functools.partial(_fp8_kernel, k=k, bk=block[0]), grid=(padded // block_m, n // tn),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)), col(k), col(kb)],
        out_specs=pl.BlockSpec((block_m, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype), interpret=interpret,
        # NOTE: Triton explicitly on GPU (JAX 0.10 would otherwise pick Mosaic GPU, whose
        # layouts this generic body does not fit); none for TPU's Mosaic, which refuses them.
        compiler_params=(None if (target or jax.default_backend()) == "tpu"
                         else pltriton.CompilerParams(num_warps=4, num_stages=2)),
    )(xp, w["qweight"], scales)
    return out[:m]

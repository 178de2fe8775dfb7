"""FP4 block-scaled matmul as a Pallas kernel: the codes are decoded one chunk of K at a time.

Grid: (row tiles of x, column tiles of the weight). Each program walks the code rows in
chunks of `chunk` (16 rows: 32 values of K, the smallest dot Triton takes): it loads the
chunk's u8 codes, decodes each nibble from its bits (E2M1: sign, two exponent bits, one
mantissa bit) with selects, builds the chunk's scale tile from the block scales as stored
(u8 E8M0 exponents as float bits, or float8_e4m3fn widened) and accumulates two float32
dots: x's even columns against the low nibbles, x's odd columns against the high ones (x is
split outside the kernel: activations are small beside the weight). NVFP4's global scale
multiplies the accumulator once. Nothing is dequantized outside the tile.

NOTE: generic Pallas (BlockSpecs, refs, `pl.ds`): the CPU runs it with `interpret=True`,
the GPU lowers it through Triton, TPU through Mosaic. Activations stay in their float dtype
(FP4 activations, W4A4, would change the numbers): the dequantized model's numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp4_matmul.reference import FP4_BLOCKS, SCALE_LEAF, check_fp4_weight


def _fp4_values(codes: jax.Array) -> jax.Array:
    """f32 E2M1 values of 4-bit codes (int32, 0..15), from their bits."""
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).astype(jnp.float32)
    base = jnp.where(exponent == 3, 4.0, jnp.where(exponent == 2, 2.0,
                                                   jnp.where(exponent == 1, 1.0, 0.5)))
    # exponent 0 is subnormal: m * 0.5; else 2^(e - 1) * (1 + m / 2).
    magnitude = base * jnp.where(exponent == 0, mantissa, 1.0 + 0.5 * mantissa)
    return jnp.where(codes >= 8, -magnitude, magnitude)


def _scales(raw: jax.Array, kind: str) -> jax.Array:
    """f32 scales of stored ones: E8M0 exponents e -> 2^(e - 127) (the float's exponent
    bits; 0 -> 2^-127, 255 -> NaN), float8_e4m3fn widened."""
    if kind == "nvfp4":
        return raw.astype(jnp.float32)
    e = raw.astype(jnp.int32)
    value = lax.bitcast_convert_type(e << 23, jnp.float32)
    return jnp.where(e == 0, 2.0 ** -127, jnp.where(e == 255, jnp.nan, value))


def _fp4_kernel(xe_ref, xo_ref, q_ref, s_ref, *rest, kind: str, chunk: int):
    g_ref, o_ref = rest if kind == "nvfp4" else (None, rest[0])
    rows_per_scale = FP4_BLOCKS[kind] // 2  # code rows one scale covers
    per_chunk = chunk // rows_per_scale
    row = lax.broadcasted_iota(jnp.int32, (chunk, o_ref.shape[1]), 0) // rows_per_scale

    def step(c, acc):
        start = c * chunk
        codes = q_ref[pl.ds(start, chunk), :].astype(jnp.int32)  # [chunk, tn]
        scale = _scales(s_ref[pl.ds(c * per_chunk, 1), :], kind)  # [1, tn] per block row
        for j in range(1, per_chunk):
            scale = jnp.where(row == j, _scales(s_ref[pl.ds(c * per_chunk + j, 1), :], kind),
                              scale)
        lo = _fp4_values(codes & 15) * scale
        hi = _fp4_values(codes >> 4) * scale
        xe = xe_ref[:, pl.ds(start, chunk)].astype(jnp.float32)
        xo = xo_ref[:, pl.ds(start, chunk)].astype(jnp.float32)
        return (acc + jnp.dot(xe, lo, preferred_element_type=jnp.float32)
                + jnp.dot(xo, hi, preferred_element_type=jnp.float32))

    acc = lax.fori_loop(0, q_ref.shape[0] // chunk, step, jnp.zeros(o_ref.shape, jnp.float32))
    if g_ref is not None:
        acc = acc * g_ref[...].astype(jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


def _tile(n: int) -> int:
    return next((t for t in (128, 64, 32, 16) if n % t == 0), n)


@functools.partial(jax.jit, static_argnames=("kind", "block_m", "chunk", "interpret", "target"))
def fp4_matmul_kernel(x: jax.Array, w: dict, kind: str, *, block_m: int = 16, chunk: int = 16,
                      interpret: bool = False, target: str | None = None) -> jax.Array:
    """x [M, K] @ the dequantized FP4 weight [K, N] -> [M, N] in x's dtype.

    Args:
        x: Activations (rows are padded to a multiple of `block_m` internally).
        w: FP4 leaves (`pallas_kernels.fp4_matmul.reference`).
        kind: "mxfp4" or "nvfp4".
        block_m: Rows of x per program.
        chunk: Code rows decoded per step (a multiple of the rows one scale covers).
        interpret: Run in the Pallas interpreter (the CPU).
        target: The platform lowered for ("gpu": Triton, "tpu": Mosaic); None: JAX's
            default backend.

    Raises:
        ValueError: Leaves that do not fit each other or x, or K / 2 not a multiple of
            `chunk`.
    """
    k, n = check_fp4_weight(w, kind)
    m = x.shape[0]
    if x.shape != (m, k):
        raise ValueError(f"x {x.shape} must be [M, {k}] for the weight")
    if (k // 2) % chunk or chunk % (FP4_BLOCKS[kind] // 2):
        raise ValueError(f"the kernel decodes {chunk} code rows at a time: K / 2 = {k // 2} "
                         f"must be a multiple of it, and it of {FP4_BLOCKS[kind] // 2}")
    padded = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, padded - m), (0, 0)))
    tn = _tile(n)
    col = lambda rows: pl.BlockSpec((rows, tn), lambda i, j: (0, j))
    rows = pl.BlockSpec((block_m, k // 2), lambda i, j: (i, 0))
    scales = w[SCALE_LEAF[kind]]
    operands = [xp[:, 0::2], xp[:, 1::2], w["qweight"], scales]  # even and odd columns of x
    specs = [rows, rows, col(k // 2), col(scales.shape[0])]
    if kind == "nvfp4":
        operands.append(w["global_scale"])
        specs.append(pl.BlockSpec((1, 1), lambda i, j: (0, 0)))
    out = pl.pallas_call(
        functools.partial(_fp4_kernel, kind=kind, chunk=chunk),
        grid=(padded // block_m, n // tn), in_specs=specs,
        out_specs=pl.BlockSpec((block_m, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype), interpret=interpret,
        # NOTE: Triton explicitly on GPU (as fp8_matmul); none for TPU's Mosaic.
        compiler_params=(None if (target or jax.default_backend()) == "tpu"
                         else pltriton.CompilerParams(num_warps=4, num_stages=2)),
    )(*operands)
    return out[:m]

"""Mamba-2's selective scan as a Pallas kernel: a grid of (heads, head-dim blocks, rows), each
program walking its row's chunks with the row's state in registers/VMEM.

Program (h, pb, r) reads rows pb of head h's state (f32[block_p, N]) from slot `slots[r]`
(zeros at the row's first chunk), folds the row's tokens in by chunks of `chunk` tokens
aligned to its first token (the SSD form of `pallas_kernels.ssd.xla`), and writes the state
back. A row of one token (a decode) takes the recurrent step on a 16-row tile instead. The
state's head-dim rows are independent (row p only reads x[:, p]), so blocks of them split
across programs. The wrapper hands the kernel X = dt x and the log decay dt a, and adds the
d skip after it (both elementwise, fused by XLA).

Inputs are head-major ([H or G, T + chunk, ...]: a chunk read past the step's end stays in
the array) and read at each chunk's token offset; tokens past a chunk's end are masked to
zero X, decay, B and C, which leave the state as it is.

Two ways to the state pool, as `pallas_kernels.gated_delta.kernel`: on the GPU the pool is
one aliased ref indexed by the row's slot inside the kernel; on TPU the slots are scalar-
prefetched and the pool's (slot, head, block) tile is the program's block (rows innermost,
so the output block of a head stays resident across rows).

NOTE: the TPU form keeps each head's whole token axis in VMEM (fine for the step buckets
served today, a few thousand tokens); longer steps want manual DMA of each chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.ssd.reference import check_ssd_shapes
from pallas_kernels.state_slots import q_lens_of

HI = lax.Precision.HIGHEST
SUB = 16  # rows of a decode tile; Triton's dots want every side >= 16


def _dot(a, b, ca=1, cb=0):
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=HI,
                           preferred_element_type=jnp.float32)


def _chunk(s, xdt, g, b, c, inside):
    """One chunk: s f32[bp, N]; xdt f32[L, bp]; g f32[L] (zero past the chunk's end, as are
    xdt, b and c); b, c f32[L, N]; inside bool[L]. Returns (y f32[L, bp], s)."""
    size = g.shape[0]
    r = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    col = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    cum = jnp.sum(jnp.where(r >= col, g[None, :], 0.0), axis=1)  # f32[L] in-chunk cumsum
    decay = jnp.exp(jnp.where(r >= col, cum[:, None] - cum[None, :], -jnp.inf))
    y = _dot(_dot(c, b, 1, 1) * decay, xdt) + jnp.exp(cum)[:, None] * _dot(c, s, 1, 1)
    last = jnp.sum(g)  # cum at the chunk's last token (g is zero past it)
    x_dec = jnp.where(inside[:, None], xdt * jnp.exp(last - cum)[:, None], 0.0)
    return y, jnp.exp(last) * s + _dot(x_dec, b, 0, 0)


def _decode(s, xdt, g, b, c):
    """One token on a SUB-row tile (rows past the first zero): (y f32[SUB, bp], s)."""
    s = jnp.exp(jnp.sum(g)) * s + _dot(xdt, b, 0, 0)
    return _dot(c, s, 1, 1), s


def _body(cu_ref, fresh_ref, load, store, s, *, chunk):
    """Row r's tokens into its state s (f32[bp, N]; made zero for a fresh row); writes its
    outputs through `store` and returns its final state. `load(start, rows, length)` gives
    (xdt, g, b, c, inside) of `rows` tokens from `start`, zero past `length`."""
    r = pl.program_id(2)
    start0, q_len = cu_ref[r], cu_ref[r + 1] - cu_ref[r]
    s = jnp.where(fresh_ref[r] != 0, 0.0, s)

    def one_chunk(j, s):
        start = start0 + j * chunk
        xdt, g, b, c, inside = load(start, chunk, q_len - j * chunk)
        y, s = _chunk(s, xdt, g, b, c, inside)
        store(start, y, inside)
        return s

    def decode(s):
        xdt, g, b, c, inside = load(start0, SUB, 1)
        y, s = _decode(s, xdt, g, b, c)
        store(start0, y, inside)
        return s

    # Decode rows take the step; longer ones the chunks (a row of 0 tokens runs neither).
    s = lax.cond(q_len == 1, decode, lambda s: s, s)
    n_chunks = jnp.where(q_len > 1, (q_len + chunk - 1) // chunk, 0)
    return lax.fori_loop(0, n_chunks, one_chunk, s)


def _loader(x_ref, g_ref, b_ref, c_ref, h=(), grp=(), rows_p=slice(None), gt=()):
    """`load` over the refs, at head `h` and group `grp` (index prefixes, empty where the
    ref is already the head's block), head-dim rows `rows_p`, and `gt` after the token
    index of g ((0,) where it is a [T', 1] column)."""
    def load(start, rows, length):
        inside = lax.broadcasted_iota(jnp.int32, (rows,), 0) < length
        at = pl.ds(start, rows)
        z2 = lambda v: jnp.where(inside[:, None], v.astype(jnp.float32), 0.0)
        return (z2(x_ref[(*h, at, rows_p)]),
                jnp.where(inside, g_ref[(*h, at, *gt)].astype(jnp.float32), 0.0),
                z2(b_ref[(*grp, at, slice(None))]), z2(c_ref[(*grp, at, slice(None))]),
                inside)
    return load


def _gpu_kernel(cu_ref, fresh_ref, slots_ref, x_ref, g_ref, b_ref, c_ref, s_in_ref,
                y_ref, s_ref, *, chunk, group, block_p):
    """Triton: whole refs, the slot's state read and written in place (aliased)."""
    del s_in_ref  # aliased to s_ref
    h, pb, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows_p = pl.ds(pb * block_p, block_p)
    slot = slots_ref[r]
    load = _loader(x_ref, g_ref, b_ref, c_ref, (h,), (h // group,), rows_p)

    def store(start, y, inside):  # masked: the rows past a chunk belong to other programs
        pltriton.store(y_ref.at[h, pl.ds(start, y.shape[0]), rows_p],
                       y.astype(y_ref.dtype), mask=inside[:, None])

    s = _body(cu_ref, fresh_ref, load, store, s_ref[slot, h, rows_p, :].astype(jnp.float32),
              chunk=chunk)

    @pl.when(cu_ref[r + 1] > cu_ref[r])  # rows without tokens (padding) write nothing
    def _():
        s_ref[slot, h, rows_p, :] = s.astype(s_ref.dtype)


def _tpu_kernel(cu_ref, fresh_ref, slots_ref, x_ref, g_ref, b_ref, c_ref, s_in_ref,
                y_ref, s_ref, *, chunk):
    """Mosaic: the slot's state tile is the program's block (scalar-prefetched slots); rows
    run in order, so a chunk's rows past its end are overwritten by the rows they belong to
    (the wrapper zeroes what follows the last row)."""
    del slots_ref  # read by the index maps
    load = _loader(x_ref, g_ref, b_ref, c_ref, gt=(0,))

    def store(start, y, inside):
        del inside
        y_ref[pl.ds(start, y.shape[0]), :] = y.astype(y_ref.dtype)

    s_in = s_in_ref[...].astype(jnp.float32)
    s = _body(cu_ref, fresh_ref, load, store, s_in, chunk=chunk)
    r = pl.program_id(2)
    # Every program writes its tile back: a padding row's (slot 0) unchanged.
    s_ref[...] = jnp.where(cu_ref[r + 1] > cu_ref[r], s, s_in).astype(s_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk", "block_p", "interpret", "target"))
def ssd_kernel(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens, *, chunk: int = 64,
               block_p: int | None = None, interpret: bool = False,
               target: str | None = None):
    """Pallas Mamba-2 selective scan; same contract as `ssd_reference`.

    Args:
        chunk: Tokens per chunk (a multiple of 16).
        block_p: State head-dim rows per program (divides P); None: min(P, 64) on the
            GPU, P on TPU (Mosaic's x tiles want 128 lanes or the whole axis).
        interpret: Run in the Pallas interpreter (the CPU).
        target: "gpu" (Triton) or "tpu" (Mosaic); None: JAX's default backend.
    """
    check_ssd_shapes(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens)
    if chunk % SUB:
        raise ValueError(f"chunk {chunk} must be a multiple of {SUB}")
    num_tokens, num_heads, head_dim = x.shape
    on_tpu = (target or jax.default_backend()) == "tpu"
    block_p = block_p or (head_dim if on_tpu else min(head_dim, 64))
    if head_dim % block_p:
        raise ValueError(f"block_p {block_p} must divide head_dim {head_dim}")
    group = num_heads // b.shape[1]
    x32, dt32 = x.astype(jnp.float32), dt.astype(jnp.float32)
    pad = max(chunk, SUB)  # a chunk read from the last token stays in the array
    head_major = lambda v: jnp.moveaxis(jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)), 0, 1)
    xh = head_major(x32 * dt32[..., None])  # f32[H, T + pad, P]: X = dt x
    gh = head_major(dt32 * a.astype(jnp.float32))  # f32[H, T + pad]: log decay
    bh, ch = (head_major(v.astype(jnp.float32)) for v in (b, c))  # f32[G, T + pad, N]
    fresh = (kv_lens == q_lens_of(cu_q_lens)).astype(jnp.int32)  # i32[R]
    grid = (num_heads, head_dim // block_p, slots.shape[0])
    out_shape = (jax.ShapeDtypeStruct(xh.shape, jnp.float32),
                 jax.ShapeDtypeStruct(state.shape, state.dtype))
    scalars = (cu_q_lens.astype(jnp.int32), fresh, slots.astype(jnp.int32))
    if on_tpu:
        y, new_state = _tpu_call(scalars, xh, gh, bh, ch, state, grid, out_shape,
                                 chunk=chunk, group=group, block_p=block_p,
                                 interpret=interpret)
    else:
        whole = pl.BlockSpec()
        y, new_state = pl.pallas_call(
            functools.partial(_gpu_kernel, chunk=chunk, group=group, block_p=block_p),
            grid=grid, in_specs=[whole] * 8, out_specs=(whole, whole), out_shape=out_shape,
            input_output_aliases={7: 1}, interpret=interpret,
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
            name=f"ssd_c{chunk}_bp{block_p}",
        )(*scalars, xh, gh, bh, ch, state)
    y = jnp.moveaxis(y, 0, 1)[:num_tokens] + d.astype(jnp.float32)[:, None] * x32
    valid = jnp.arange(num_tokens) < cu_q_lens[-1]
    y = jnp.where(valid[:, None, None], y, 0.0)  # f32[T, H, P]
    return y, new_state  # rows without tokens left their slot as it was


def _tpu_call(scalars, xh, gh, bh, ch, state, grid, out_shape, *, chunk, group, block_p,
              interpret):
    """The Mosaic pallas_call: slots scalar-prefetched into the state tiles' index maps."""
    tokens = xh.shape[1]
    state_size = bh.shape[2]
    per_head = pl.BlockSpec((None, tokens, block_p), lambda h, pb, r, *_: (h, 0, pb))
    per_token = pl.BlockSpec((None, tokens, 1), lambda h, pb, r, *_: (h, 0, 0))
    per_group = pl.BlockSpec((None, tokens, state_size),
                             lambda h, pb, r, *_: (h // group, 0, 0))
    tile = pl.BlockSpec((None, None, block_p, state_size),
                        lambda h, pb, r, cu, fresh, slots: (slots[r], h, pb, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=grid,
        in_specs=[per_head, per_token, per_group, per_group, tile], out_specs=(per_head, tile))
    return pl.pallas_call(
        functools.partial(_tpu_kernel, chunk=chunk), grid_spec=grid_spec,
        out_shape=out_shape, input_output_aliases={7: 1},
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        name=f"ssd_tpu_c{chunk}_bp{block_p}",
    )(*scalars, xh, gh[..., None], bh, ch, state)

"""The gated delta rule as a Pallas kernel: a grid of (value heads, value-dim blocks, rows),
each program walking its row's chunks with the row's state in registers/VMEM.

Program (h, vb, r) reads row r's state columns vb of head h from slot `slots[r]` (zeros
at the row's first chunk), folds the row's tokens in by chunks of `chunk` tokens aligned to
its first token (the WY form of `pallas_kernels.gated_delta.xla`; the UT system's inverse by
forward substitution on 16-token diagonal blocks, merged by a short Neumann series in the
strictly block-lower part, as flash-linear-attention does), and writes the state back. A
row of one token (a decode) takes the recurrent step on a 16-row tile instead. The state's
value columns are independent in the delta rule, so blocks of them split across programs.

Inputs are head-major ([H, T + chunk, d]: a chunk read past the step's end stays in the
array) and read at each chunk's token offset; tokens past a chunk's end are masked to
zero k, beta and g, which leave the state as it is.

Two ways to the state pool: on the GPU (Triton has no scalar prefetch) the pool is one
aliased ref indexed by the row's slot inside the kernel; on TPU the slots are scalar-
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

from pallas_kernels.gated_delta.reference import check_gated_delta_shapes
from pallas_kernels.state_slots import q_lens_of

HI = lax.Precision.HIGHEST
SUB = 16  # rows of a diagonal block of the UT inverse, and of a decode tile


def _dot(a, b, ca=1, cb=0):
    return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=HI,
                           preferred_element_type=jnp.float32)


def _iota(n: int, axis: int):
    return lax.broadcasted_iota(jnp.int32, (n, n), axis)


def _ut_inverse(lm: jax.Array) -> jax.Array:
    """(I + lm)^-1 of a strictly lower-triangular f32[L, L] (L a multiple of SUB)."""
    size = lm.shape[0]
    r, c = _iota(size, 0), _iota(size, 1)
    eye = jnp.where(r == c, 1.0, 0.0)
    shift = SUB.bit_length() - 1
    diag = jnp.where((r >> shift) == (c >> shift), lm, 0.0)  # the 16x16 diagonal blocks

    def row(i, t):  # row i of every diagonal block, from its rows above (already final)
        sel = (r & (SUB - 1)) == i
        return jnp.where(sel, eye - _dot(jnp.where(sel, diag, 0.0), t), t)

    t = lax.fori_loop(1, SUB, row, eye)
    # I + lm = (I + diag)(I + N), N = t (lm - diag) strictly block-lower: N^(L/16) = 0.
    n = _dot(t, lm - diag)
    term, total = eye, eye
    for _ in range(size // SUB - 1):
        term = -_dot(term, n)
        total = total + term
    return _dot(total, t)


def _chunk(s, q, k, v, g, beta, inside):
    """One chunk: s f32[dk, bv]; q, k f32[L, dk]; v f32[L, bv]; g, beta f32[L] (zero past
    the chunk's end, as are k and v); inside bool[L]. Returns (out f32[L, bv], s)."""
    size = g.shape[0]
    r, col = _iota(size, 0), _iota(size, 1)
    cum = jnp.sum(jnp.where(r >= col, g[None, :], 0.0), axis=1)  # f32[L] in-chunk cumsum
    decay = jnp.exp(jnp.where(r >= col, cum[:, None] - cum[None, :], -jnp.inf))
    kb = k * beta[:, None]
    t = _ut_inverse(jnp.where(r > col, _dot(kb, k, 1, 1) * decay, 0.0))
    new_v = _dot(t, v * beta[:, None])  # f32[L, bv]
    k_cum = _dot(t, kb * jnp.exp(cum)[:, None])  # f32[L, dk]
    v_new = new_v - _dot(k_cum, s)
    out = _dot(q * jnp.exp(cum)[:, None], s) + _dot(_dot(q, k, 1, 1) * decay, v_new)
    last = jnp.sum(g)  # cum at the chunk's last token (g is zero past it)
    k_dec = jnp.where(inside[:, None], k * jnp.exp(last - cum)[:, None], 0.0)
    return out, jnp.exp(last) * s + _dot(k_dec, v_new, 0, 0)


def _decode(s, q, k, v, g, beta):
    """One token on a SUB-row tile (rows past the first zero): (out f32[SUB, bv], s)."""
    s = jnp.exp(jnp.sum(g)) * s
    u = beta[:, None] * (v - _dot(k, s))  # f32[SUB, bv]
    s = s + _dot(k, u, 0, 0)
    return _dot(q, s), s


def _body(cu_ref, fresh_ref, load, store, s, *, chunk):
    """Row r's tokens into its state s (f32[dk, bv]; made zero for a fresh row); writes
    its outputs through `store` and returns its final state. `load(start, rows, length)`
    gives (q, k, v, g, beta, inside) of `rows` tokens from `start`, zero past `length`."""
    r = pl.program_id(2)
    start0, q_len = cu_ref[r], cu_ref[r + 1] - cu_ref[r]
    s = jnp.where(fresh_ref[r] != 0, 0.0, s)

    def one_chunk(j, s):
        start = start0 + j * chunk
        q, k, v, g, beta, inside = load(start, chunk, q_len - j * chunk)
        o, s = _chunk(s, q, k, v, g, beta, inside)
        store(start, o, inside)
        return s

    def decode(s):
        q, k, v, g, beta, inside = load(start0, SUB, 1)
        o, s = _decode(s, q, k, v, g, beta)
        store(start0, o, inside)
        return s

    # Decode rows take the step; longer ones the chunks (a row of 0 tokens runs neither).
    s = lax.cond(q_len == 1, decode, lambda s: s, s)
    n_chunks = jnp.where(q_len > 1, (q_len + chunk - 1) // chunk, 0)
    return lax.fori_loop(0, n_chunks, one_chunk, s)


def _loader(q_ref, k_ref, v_ref, g_ref, beta_ref, kh=(), vh=(), cols=slice(None), gt=()):
    """`load` over the refs, at key head `kh` and value head `vh` (index prefixes, empty
    where the ref is already the head's block), value columns `cols`, and `gt` after the
    token index of g and beta ((0,) where they are [T', 1] columns)."""
    def load(start, rows, length):
        inside = lax.broadcasted_iota(jnp.int32, (rows,), 0) < length
        at = pl.ds(start, rows)
        z2 = lambda x: jnp.where(inside[:, None], x.astype(jnp.float32), 0.0)
        z1 = lambda x: jnp.where(inside, x.astype(jnp.float32), 0.0)
        return (z2(q_ref[(*kh, at, slice(None))]), z2(k_ref[(*kh, at, slice(None))]),
                z2(v_ref[(*vh, at, cols)]), z1(g_ref[(*vh, at, *gt)]),
                z1(beta_ref[(*vh, at, *gt)]),
                inside)
    return load


def _gpu_kernel(cu_ref, fresh_ref, slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_in_ref,
                out_ref, s_ref, *, chunk, group, block_v):
    """Triton: whole refs, the slot's state read and written in place (aliased)."""
    del s_in_ref  # aliased to s_ref
    h, vb, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(vb * block_v, block_v)
    slot = slots_ref[r]
    load = _loader(q_ref, k_ref, v_ref, g_ref, beta_ref, (h // group,), (h,), cols)

    def store(start, o, inside):  # masked: the rows past a chunk belong to other programs
        pltriton.store(out_ref.at[h, pl.ds(start, o.shape[0]), cols],
                       o.astype(out_ref.dtype), mask=inside[:, None])

    s = _body(cu_ref, fresh_ref, load, store, s_ref[slot, h, :, cols].astype(jnp.float32),
              chunk=chunk)

    @pl.when(cu_ref[r + 1] > cu_ref[r])  # rows without tokens (padding) write nothing
    def _():
        s_ref[slot, h, :, cols] = s.astype(s_ref.dtype)


def _tpu_kernel(cu_ref, fresh_ref, slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_in_ref,
                out_ref, s_ref, *, chunk):
    """Mosaic: the slot's state tile is the program's block (scalar-prefetched slots); rows
    run in order, so a chunk's rows past its end are overwritten by the rows they belong to
    (the wrapper zeroes what follows the last row)."""
    del slots_ref  # read by the index maps
    load = _loader(q_ref, k_ref, v_ref, g_ref, beta_ref, gt=(0,))

    def store(start, o, inside):
        del inside
        out_ref[pl.ds(start, o.shape[0]), :] = o.astype(out_ref.dtype)

    s_in = s_in_ref[...].astype(jnp.float32)
    s = _body(cu_ref, fresh_ref, load, store, s_in, chunk=chunk)
    r = pl.program_id(2)
    # Every program writes its tile back: a padding row's (slot 0) unchanged.
    s_ref[...] = jnp.where(cu_ref[r + 1] > cu_ref[r], s, s_in).astype(s_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "interpret", "target"))
def gated_delta_rule_kernel(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens, *,
                            chunk: int = 64, block_v: int | None = None,
                            interpret: bool = False, target: str | None = None):
    """Pallas gated delta rule; same contract as `gated_delta_rule_reference`.

    Args:
        chunk: Tokens per chunk (a multiple of 16).
        block_v: State value columns per program (divides dv); None: min(dv, 64) on the
            GPU, dv on TPU (Mosaic's tiles want 128 lanes or the whole axis).
        interpret: Run in the Pallas interpreter (the CPU).
        target: "gpu" (Triton) or "tpu" (Mosaic); None: JAX's default backend.
    """
    check_gated_delta_shapes(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens)
    if chunk % SUB:
        raise ValueError(f"chunk {chunk} must be a multiple of {SUB}")
    num_tokens, num_v_heads, dv = v.shape
    num_k_heads, dk = q.shape[1:]
    on_tpu = (target or jax.default_backend()) == "tpu"
    block_v = block_v or (dv if on_tpu else min(dv, 64))
    if dv % block_v:
        raise ValueError(f"block_v {block_v} must divide dv {dv}")
    group = num_v_heads // num_k_heads
    pad = max(chunk, SUB)  # a chunk read from the last token stays in the array
    head_major = lambda x: jnp.moveaxis(jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)), 0, 1)
    qh, kh, vh, gh, bh = (head_major(x) for x in (q, k, v, g, beta))  # [H, T + pad, ...]
    q_lens = q_lens_of(cu_q_lens)
    fresh = (kv_lens == q_lens).astype(jnp.int32)  # i32[R]
    num_rows = slots.shape[0]
    grid = (num_v_heads, dv // block_v, num_rows)
    out_shape = (jax.ShapeDtypeStruct(vh.shape, jnp.float32),
                 jax.ShapeDtypeStruct(state.shape, state.dtype))
    scalars = (cu_q_lens.astype(jnp.int32), fresh, slots.astype(jnp.int32))
    if on_tpu:
        out, new_state = _tpu_call(scalars, qh, kh, vh, gh, bh, state, grid, out_shape,
                                   chunk=chunk, group=group, block_v=block_v,
                                   interpret=interpret)
    else:
        whole = pl.BlockSpec()
        out, new_state = pl.pallas_call(
            functools.partial(_gpu_kernel, chunk=chunk, group=group, block_v=block_v),
            grid=grid, in_specs=[whole] * 9, out_specs=(whole, whole), out_shape=out_shape,
            input_output_aliases={8: 1}, interpret=interpret,
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
            name=f"gated_delta_c{chunk}_bv{block_v}",
        )(*scalars, qh, kh, vh, gh, bh, state)
    out = jnp.moveaxis(out, 0, 1)[:num_tokens]  # f32[T, Hv, dv]
    valid = jnp.arange(num_tokens) < cu_q_lens[-1]
    out = jnp.where(valid[:, None, None], out, 0.0)
    return out, new_state  # rows without tokens left their slot as it was


def _tpu_call(scalars, qh, kh, vh, gh, bh, state, grid, out_shape, *, chunk, group, block_v,
              interpret):
    """The Mosaic pallas_call: slots scalar-prefetched into the state tiles' index maps."""
    tokens = qh.shape[1]
    dk = qh.shape[2]
    key = pl.BlockSpec((None, tokens, dk), lambda h, vb, r, *_: (h // group, 0, 0))
    val = pl.BlockSpec((None, tokens, block_v), lambda h, vb, r, *_: (h, 0, vb))
    per_token = pl.BlockSpec((None, tokens, 1), lambda h, vb, r, *_: (h, 0, 0))
    tile = pl.BlockSpec((None, None, dk, block_v),
                        lambda h, vb, r, cu, fresh, slots: (slots[r], h, 0, vb))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=grid,
        in_specs=[key, key, val, per_token, per_token, tile], out_specs=(val, tile))
    return pl.pallas_call(
        functools.partial(_tpu_kernel, chunk=chunk), grid_spec=grid_spec,
        out_shape=out_shape, input_output_aliases={8: 1},
        interpret=pltpu.InterpretParams() if interpret else False,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        name=f"gated_delta_tpu_c{chunk}_bv{block_v}",
    )(*scalars, qh, kh, vh, gh[..., None], bh[..., None], state)

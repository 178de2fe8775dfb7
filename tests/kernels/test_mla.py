"""MLA over latent pages: the XLA path and the Pallas kernels (interpreter) against the jnp
reference, the absorbed form against the expanded one, the latent write (float and 8-bit),
the page helpers on latent pools, bad shapes, and the Triton and Mosaic lowerings."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.kv_ops import HostSwapSpace, copy_page_pairs
from pallas_kernels import AttentionMetadata, AttentionOps, write_latent
from pallas_kernels.kv_quant import kv_pool_layout
from pallas_kernels.metadata import latent_pages_shape
from pallas_kernels.mla.kernel import mla_attention_kernel
from pallas_kernels.mla.kernel_tpu import mla_attention_tpu
from pallas_kernels.mla.reference import (
    mla_attention_reference,
    mla_expanded_reference,
    write_latent_reference,
)
from pallas_kernels.mla.xla import mla_attention_xla
from tests.kernels.cases import Geometry, make_metadata, make_pool, slow_except, tolerance

RANK, ROPE, HEADS = 32, 16, 4  # kv_lora_rank, qk_rope_head_dim, query heads
SCALE = 0.2
# A ragged step: a decode row, a first chunk, a decode row out of order, a later chunk of
# a long context (several pages), a padding request; then padded tokens.
Q_LENS, KV_LENS = [1, 7, 1, 9, 0], [5, 7, 13, 30, 0]


def geometry(dtype="float32", page_size=4) -> Geometry:
    return Geometry(page_size, 1, HEADS, RANK + ROPE, dtype, num_pages=40, num_seqs=5,
                    num_tokens=24, width=32 // page_size)


def inputs(g: Geometry, poison=np.nan, seed=0, q_lens=Q_LENS, kv_lens=KV_LENS):
    """(q_latent, q_pe, latent pool, md): random latents in owned pages (shuffled), `poison`
    in free and null pages."""
    rng = np.random.default_rng(seed)
    pool, tables = make_pool(g, kv_lens, rng, poison)  # [L, 2, 1, P, ps, W]
    pool = pool[:, :1]  # a latent pool: one K/V entry, one head
    assert pool.shape == latent_pages_shape(g.num_layers, g.num_pages, g.page_size, g.head_dim)
    md = make_metadata(g, q_lens, kv_lens, tables)
    q_latent = jnp.asarray(rng.standard_normal((g.num_tokens, HEADS, RANK)), g.dtype)
    q_pe = jnp.asarray(rng.standard_normal((g.num_tokens, HEADS, ROPE)), g.dtype)
    return q_latent, q_pe, pool, md


def jitted(fn, **kw):
    """`fn` compiled whole (as the model calls it): op by op, its loops compile apart."""
    return jax.jit(functools.partial(fn, sm_scale=SCALE, **kw))


REFERENCE = jitted(mla_attention_reference)
# Small tiles: several key blocks per tile, several tiles per chunk, decode rows sharing
# iterations (the tuned sizes run through `AttentionOps` below).
XLA_SMALL = jitted(mla_attention_xla, block_kv=8, block_q=4, decode_block_kv=4, decode_rows=2)


@pytest.fixture(scope="module")
def case():
    args = inputs(geometry())
    return args, np.asarray(REFERENCE(*args[:3], 1, args[3]))


def test_reference_is_causal_ragged_attention_with_zero_padding(case):
    (q_latent, q_pe, pool, md), want = case
    assert np.isfinite(want).all()
    assert not want[int(md.cu_q_lens[-1]):].any()  # padded tokens
    # Token 1 (the first chunk's first token, position 0) sees its one key: out == c_kv[0].
    page = int(md.block_tables[1, 0])
    np.testing.assert_allclose(want[1], np.broadcast_to(pool[1, 0, 0, page, 0, :RANK],
                                                        (HEADS, RANK)), rtol=1e-6)


def test_absorbed_equals_expanded(case):
    (q_latent, q_pe, pool, md), want = case
    rng = np.random.default_rng(1)
    dn, dv = 8, 12
    w_uk = jnp.asarray(rng.standard_normal((RANK, HEADS, dn)) / 4, jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((RANK, HEADS, dv)), jnp.float32)
    q_nope = jnp.asarray(rng.standard_normal((md.slot_mapping.shape[0], HEADS, dn)), jnp.float32)
    expanded = jitted(mla_expanded_reference)(q_nope, q_pe, pool, 1, md, w_uk, w_uv)
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk)  # W_UK absorbed into the query
    latent_out = REFERENCE(q_latent, q_pe, pool, 1, md)  # the XLA path and kernels match it
    absorbed = jnp.einsum("thr,rhv->thv", latent_out, w_uv)  # one up-projection after
    np.testing.assert_allclose(absorbed, expanded, atol=1e-4, rtol=1e-4)


def test_xla_matches_reference(case):
    (q_latent, q_pe, pool, md), want = case
    got = np.asarray(XLA_SMALL(q_latent, q_pe, pool, 1, md))
    np.testing.assert_allclose(got, want, atol=tolerance("float32"), rtol=0)


@pytest.mark.parametrize("poison", [0.0, 1e4])
def test_poison_in_free_and_null_pages_changes_nothing(case, poison):
    (q_latent, q_pe, pool, md), want = case  # the module's case holds NaN there
    _, _, other, _ = inputs(geometry(), poison=poison)
    got = np.asarray(XLA_SMALL(q_latent, q_pe, other, 1, md))
    np.testing.assert_allclose(got, want, atol=tolerance("float32"), rtol=0)


@pytest.mark.parametrize("dtype,page_size", slow_except([("float32", 4), ("bfloat16", 8)], 0))
def test_kernel_matches_reference_in_interpreter(dtype, page_size):
    q_latent, q_pe, pool, md = inputs(geometry(dtype, page_size))
    want = np.asarray(REFERENCE(q_latent, q_pe, pool, 1, md), np.float32)
    got = np.asarray(mla_attention_kernel(q_latent, q_pe, pool, 1, md, sm_scale=SCALE,
                                          block_q=4, pages_per_block=2, interpret=True),
                     np.float32)
    np.testing.assert_allclose(got, want, atol=tolerance(dtype), rtol=0)


@pytest.mark.slow  # the TPU interpreter: ~3 s a call here; its Mosaic lowering stays default
def test_tpu_kernel_matches_reference_in_interpreter(case):
    (q_latent, q_pe, pool, md), want = case
    got = np.asarray(mla_attention_tpu(q_latent, q_pe, pool, 1, md, sm_scale=SCALE,
                                       block_q=4, pages_per_block=2, interpret=True))
    np.testing.assert_allclose(got, want, atol=tolerance("float32"), rtol=0)


# NOTE: "xla" compiles the XLA path a second time (tuned sizes, ~4 s here): slow tier.
@pytest.mark.parametrize("backend", slow_except(["xla", "pallas"], 1))
def test_ops_write_then_attend(case, backend):
    # The model's calls: write this step's latents into the pool, then attend.
    (q_latent, q_pe, pool, md), _ = case
    rng = np.random.default_rng(2)
    latent = jnp.asarray(rng.standard_normal((md.slot_mapping.shape[0], RANK + ROPE)),
                         jnp.float32)
    ops = AttentionOps(backend)

    @jax.jit
    def step(pool, latent, q_latent, q_pe, md):
        pool = ops.write_latent(pool, 1, latent, md.slot_mapping)
        return pool, ops.mla_attend(q_latent, q_pe, pool, 1, md, sm_scale=SCALE)

    new, out = step(pool, latent, q_latent, q_pe, md)
    want = np.asarray(REFERENCE(q_latent, q_pe, new, 1, md))
    np.testing.assert_allclose(np.asarray(out), want, atol=tolerance("float32"), rtol=0)


def test_batch_invariant_mla_is_refused(case):
    (q_latent, q_pe, pool, md), _ = case
    with pytest.raises(ValueError, match="batch_invariant"):
        AttentionOps("xla", batch_invariant=True).mla_attend(q_latent, q_pe, pool, 1, md,
                                                              sm_scale=SCALE)


def test_write_latent_writes_rows_and_drops_the_null_page():
    pool = jnp.zeros((2, 1, 1, 6, 4, RANK + ROPE), jnp.float32)
    latent = jnp.arange(3 * (RANK + ROPE), dtype=jnp.float32).reshape(3, -1) + 1
    slots = jnp.asarray([9, 2, 20], jnp.int32)  # page 2 offset 1; the null page; page 5
    new = np.asarray(write_latent(pool, 1, latent, slots))
    np.testing.assert_array_equal(new[1, 0, 0, 2, 1], latent[0])
    np.testing.assert_array_equal(new[1, 0, 0, 5, 0], latent[2])
    assert np.count_nonzero(new.any(-1)) == 2  # nothing else, the null page included


@pytest.mark.parametrize("storage", slow_except(["int8", "fp8_e4m3"], 0))
def test_8bit_latent_pool(case, storage):
    # One scale per token row (c_kv and k_pe together), as `pack_for_pool` does for a head.
    (q_latent, q_pe, pool, md), want = case
    shape, dtype = kv_pool_layout(pool.shape, jnp.float32, storage)
    assert shape[-1] == RANK + ROPE + 4
    rows = jnp.nan_to_num(pool[1, 0, 0].reshape(-1, RANK + ROPE))  # every slot's row
    slots = jnp.arange(rows.shape[0], dtype=jnp.int32)
    q8 = jax.jit(write_latent_reference)(jnp.zeros(shape, dtype), 1, rows, slots)
    ref = np.asarray(REFERENCE(q_latent, q_pe, q8, 1, md))
    np.testing.assert_allclose(ref, want, atol={"int8": 0.05, "fp8_e4m3": 0.2}[storage])
    with pytest.raises(ValueError, match="float latent pools only"):
        mla_attention_kernel(q_latent, q_pe, q8, 1, md, sm_scale=SCALE, interpret=True)
    if storage == "int8":  # the XLA path's compile for an 8-bit pool: once, slow tier
        return
    got = np.asarray(XLA_SMALL(q_latent, q_pe, q8, 1, md))
    np.testing.assert_allclose(got, ref, atol=tolerance("float32"), rtol=0)


def test_page_helpers_move_latent_pages(case):
    # Copy-on-write and swap index pages on axis 3 only: latent pages move as any page.
    (_, _, pool, _), _ = case
    pool = jnp.nan_to_num(pool)
    pairs = np.asarray([[3, 7], [5, 9]], np.int32)
    copied = np.asarray(copy_page_pairs(jnp.copy(pool), pairs))  # donates its pool
    np.testing.assert_array_equal(copied[:, :, :, 7], np.asarray(pool)[:, :, :, 3])
    swap = HostSwapSpace(4, pool.shape[:3] + pool.shape[4:], np.float32)
    swap.swap_out(pool, np.asarray([[5, 0]], np.int32))
    back = np.asarray(swap.swap_in(jnp.zeros_like(pool), np.asarray([[0, 2]], np.int32)))
    np.testing.assert_array_equal(back[:, :, :, 2], np.asarray(pool)[:, :, :, 5])


def _bad(case, what):
    (q_latent, q_pe, pool, md), _ = case
    args = dict(q_latent=q_latent, q_pe=q_pe, pool=pool, md=md)
    args.update(what(args))
    return args


BAD = {  # argument named in the error -> how it is broken
    "q_latent": lambda a: dict(q_latent=a["q_latent"][0]),
    "q_pe": lambda a: dict(q_pe=a["q_pe"][:, :2]),
    "kv_lora_rank": lambda a: dict(q_latent=a["q_latent"][..., :RANK - 1]),
    "pool": lambda a: dict(pool=jnp.concatenate([a["pool"]] * 2, axis=1)),
    "q_pe dtype": lambda a: dict(q_pe=a["q_pe"].astype(jnp.bfloat16)),
    "md.slot_mapping": lambda a: dict(md=AttentionMetadata(
        a["md"].slot_mapping[:3], a["md"].block_tables, a["md"].kv_lens, a["md"].cu_q_lens)),
    "md.cu_q_lens": lambda a: dict(md=AttentionMetadata(
        a["md"].slot_mapping, a["md"].block_tables, a["md"].kv_lens, a["md"].cu_q_lens[:-1])),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_shapes_name_the_argument(case, name):
    args = _bad(case, BAD[name])
    for fn in (mla_attention_reference, mla_attention_xla,
               functools.partial(mla_attention_kernel, interpret=True)):
        with pytest.raises(ValueError, match=name):
            fn(args["q_latent"], args["q_pe"], args["pool"], 1, args["md"], sm_scale=SCALE)


def test_bad_write_names_the_argument(case):
    (_, _, pool, md), _ = case
    with pytest.raises(ValueError, match="latent"):
        write_latent(pool, 1, jnp.zeros((24, RANK), jnp.float32), md.slot_mapping)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_latent(pool, 1, jnp.zeros((24, RANK + ROPE), jnp.float32), md.slot_mapping[:3])
    with pytest.raises(ValueError, match="pool"):
        write_latent(jnp.zeros((2, 2, 1, 4, 4, RANK + ROPE)), 1,
                     jnp.zeros((24, RANK + ROPE), jnp.float32), md.slot_mapping)


def _abstract(dtype, rank, rope, heads, page_size):
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    return (jax.ShapeDtypeStruct((32, heads, rank), dtype),
            jax.ShapeDtypeStruct((32, heads, rope), dtype),
            jax.ShapeDtypeStruct((2, 1, 1, 32, page_size, rank + rope), dtype), i32(),
            AttentionMetadata(i32(32), i32(4, 8), i32(4), i32(5)))


# DeepSeek-V3's latent (512 + 64) with 16 heads (128 over tensor parallelism 8), and a tiny one.
SHAPES = [("bfloat16", 512, 64, 16, 16), ("float32", 32, 16, 4, 8)]


@pytest.mark.parametrize("dtype,rank,rope,heads,page_size", SHAPES)
def test_kernel_lowers_to_triton(dtype, rank, rope, heads, page_size):
    fn = functools.partial(mla_attention_kernel, sm_scale=0.1, pages_per_block=2)
    lowered = jax.jit(fn).trace(*_abstract(dtype, rank, rope, heads, page_size)).lower(
        lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


@pytest.mark.parametrize("dtype,rank,rope,heads,page_size", SHAPES)
def test_kernel_lowers_to_mosaic(fake_tpu_info, dtype, rank, rope, heads, page_size):
    fn = functools.partial(mla_attention_tpu, sm_scale=0.1, pages_per_block=2)
    lowered = jax.jit(fn).trace(*_abstract(dtype, rank, rope, heads, page_size)).lower(
        lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()

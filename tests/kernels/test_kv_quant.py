"""8-bit KV pages: the row codec, every attention path over a poisoned 8-bit pool, the KV write."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.utils import cdiv
from pallas_kernels.kv_quant import (
    KV_CACHE_STORAGE,
    dequantize_kv,
    is_quantized,
    kv_head_dim,
    kv_rotation,
    quantize_kv,
)
from pallas_kernels.kv_write.kernel import write_kv_kernel
from pallas_kernels.kv_write.reference import write_kv_reference
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention_kernel
from pallas_kernels.paged_decode_attention.reference import paged_decode_attention_reference
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention_kernel
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from tests.kernels.cases import Geometry, make_metadata, slow_except

# storage name -> (dtype, largest code, bits of significand rounding: |rel err| <= 2^-bits,
# half the spacing of subnormal codes)
STORAGE = {"int8": (jnp.int8, 127.0, None, 0.5),
           "fp8_e4m3": (jnp.float8_e4m3fn, 448.0, 4, 2.0 ** -10),
           "fp8_e5m2": (jnp.float8_e5m2, 57344.0, 3, 2.0 ** -17)}
SM_SCALE = 0.125
ATOL = 1e-5


def _rows(shape, seed=0, spread=3.0):
    """f32 rows whose magnitudes differ by up to 10^(+-spread) (the scale is per row)."""
    rng = np.random.default_rng(seed)
    mag = 10.0 ** rng.uniform(-spread, spread, shape[:-1] + (1,))
    return (rng.standard_normal(shape) * mag).astype(np.float32)


def _scale_bytes(rows: np.ndarray) -> np.ndarray:
    """The float32 scale stored in the last 4 bytes of each row (independent of the codec)."""
    return np.ascontiguousarray(rows.view(np.uint8)[..., -4:]).view("<f4")[..., 0]


def _codes_f32(rows: np.ndarray) -> np.ndarray:
    return rows[..., :-4].astype(np.float32)


def _nan_bytes(dtype) -> np.ndarray:
    """The byte values that are NaN codes of `dtype` (e5m2: six of them; int8: none)."""
    b = np.arange(256, dtype=np.uint8)
    return b[np.isnan(b.view(dtype).astype(np.float32))] if np.dtype(dtype).kind != "i" else b[:0]


def _has_nan_byte(scale: np.ndarray, dtype) -> np.ndarray:
    """bool[...]: whether a float32 scale's bytes include a NaN code of `dtype`."""
    b = np.ascontiguousarray(scale, "<f4")[..., None].view(np.uint8)
    return np.isin(b, _nan_bytes(dtype)).any(-1)


def _want_scale(x: np.ndarray, name: str) -> np.ndarray:
    """The scale quantize_kv stores: max|x| / qmax, rounded up to a power of two for fp8."""
    scale = np.abs(x).max(-1) / np.float32(STORAGE[name][1])
    return scale if name == "int8" else (2.0 ** np.ceil(np.log2(scale))).astype(np.float32)


def _encode(x: np.ndarray, name: str, nudge: bool = True) -> np.ndarray:
    """u8[..., D + 4]: `x` as an 8-bit pool row, in numpy alone (the codec's oracle).

    With `nudge`, scales whose bytes hold a NaN code of the storage dtype are nudged off it
    (see `test_scale_bytes_that_are_fp8_nan_codes_*` for what happens to those).
    """
    dtype, qmax = STORAGE[name][:2]
    scale = (np.abs(x).max(-1) / np.float32(qmax)).astype(np.float32)
    b = scale[..., None].view(np.uint8).copy()
    if nudge:
        b[np.isin(b, _nan_bytes(dtype))] = 0x7C
    scale = b.view("<f4")[..., 0]
    scaled = np.clip(x / scale[..., None], -qmax, qmax)
    codes = np.rint(scaled).astype(np.int8) if name == "int8" else scaled.astype(dtype)
    return np.concatenate([codes.view(np.uint8), b], axis=-1)


@pytest.mark.parametrize("name", list(STORAGE))
def test_round_trip_error_bounds_and_scale_bytes(name):
    dtype, qmax, bits, sub = STORAGE[name]
    x = _rows((3, 5, 64), seed=1)
    packed = quantize_kv(jnp.asarray(x), dtype)
    assert packed.dtype == dtype and packed.shape == (3, 5, 68)
    rows = np.asarray(packed)
    scale = _scale_bytes(rows)  # f32[3, 5]
    got = np.asarray(dequantize_kv(packed))
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, _codes_f32(rows) * scale[..., None])
    assert not _has_nan_byte(scale, dtype).any()  # fp8: power-of-two scales
    # NOTE: XLA's CPU division may be an ulp off IEEE's: compare to 2 ulps.
    np.testing.assert_allclose(scale, _want_scale(x, name), rtol=2.0 ** -22)
    err = np.abs(got.astype(np.float64) - x)
    s = scale.astype(np.float64)[..., None]
    if bits is None:  # int8: rounding to the nearest code
        bound = s * 0.5 * (1 + 1e-6)
        assert np.abs(_codes_f32(rows)).max() == 127
    else:  # fp8: relative rounding of normal codes, absolute of subnormal ones
        bound = (2.0 ** -bits * np.abs(x) + sub * s) * (1 + 1e-6)
        assert (err <= 2.0 ** -bits * np.abs(x).max(-1, keepdims=True)).all()
    assert (err <= bound).all(), float((err - bound).max())
    assert (err > 0.25 * bound).any(), "the bound should be tight"
    if bits is not None:
        return
    # int8: the row max is stored exactly: its code is the largest one.
    row_max = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)
    np.testing.assert_allclose(np.take_along_axis(got, np.abs(x).argmax(-1)[..., None], -1),
                               row_max, rtol=1e-6)


@pytest.mark.parametrize("name", list(STORAGE))
def test_zero_row_round_trips_to_zeros(name):
    dtype = STORAGE[name][0]
    x = _rows((4, 32), seed=2)
    x[1] = 0.0
    packed = quantize_kv(jnp.asarray(x, jnp.bfloat16), dtype)  # any float input
    rows = np.asarray(packed)
    assert _scale_bytes(rows)[1] > 0  # no 0 / 0 on the way back
    got = np.asarray(dequantize_kv(packed))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_array_equal(_codes_f32(rows)[1], 0.0)
    assert np.abs(got[0]).max() > 0


def _nan_coded_scales(name):
    """(x f32[4, 16], scale f32[4]): rows whose scale max|x| / qmax has bytes 1 and 2 among
    0x7D-0x7F / 0xFD-0xFF (all NaN codes of e5m2; each row has e4m3fn's 0x7F or 0xFF)."""
    qmax = STORAGE[name][1]
    words = np.array([0x3BFF7D80, 0x3BFE7F80, 0x3BFDFF80, 0x3C7FFF80], "<u4")
    scale = words.view(np.float32)
    x = _rows((4, 16), seed=9, spread=0.0) * scale[:, None] * 0.5  # |x| < qmax * scale
    x[:, 3] = scale * np.float32(qmax)  # the row max: exactly qmax * scale
    return x, np.abs(x).max(-1) / np.float32(qmax)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_scales_are_powers_of_two_without_nan_code_bytes(name):
    # Rows whose exact scale max|x| / qmax would hold e5m2 NaN-code bytes (0x7D-0x7F,
    # 0xFD-0xFF), which XLA rewrites when it moves fp8 data: stored scales avoid them.
    dtype, qmax, bits, sub = STORAGE[name]
    x, exact = _nan_coded_scales(name)
    assert _has_nan_byte(exact, jnp.float8_e5m2).all()
    for fn in (quantize_kv, jax.jit(quantize_kv, static_argnums=1)):
        rows = np.asarray(fn(jnp.asarray(x), dtype))
        scale = _scale_bytes(rows)
        np.testing.assert_array_equal(scale, _want_scale(x, name))
        assert not _has_nan_byte(scale, dtype).any()
        got = np.asarray(jax.jit(dequantize_kv)(jnp.asarray(rows)))
        np.testing.assert_array_equal(got, _codes_f32(rows) * scale[:, None])
        err = np.abs(got - x)
        assert (err <= 2.0 ** -bits * np.abs(x) + sub * scale[:, None]).all()


@pytest.mark.parametrize("name", ["fp8_e4m3"])
def test_scale_bytes_that_are_fp8_nan_codes_survive_dequantize_kv(name):
    dtype = STORAGE[name][0]
    x, scale = _nan_coded_scales(name)
    codes = (x / scale[:, None]).astype(dtype)
    rows = np.concatenate([codes.view(np.uint8), scale[:, None].view(np.uint8)], -1)
    want = codes.astype(np.float32) * scale[:, None]
    pool = jnp.asarray(rows.view(dtype))
    np.testing.assert_array_equal(np.asarray(dequantize_kv(pool)), want)  # op by op
    np.testing.assert_array_equal(np.asarray(jax.jit(dequantize_kv)(pool)), want)


def test_pool_dtypes_and_head_dim():
    assert KV_CACHE_STORAGE["fp8"] == jnp.float8_e4m3fn
    assert {n: KV_CACHE_STORAGE[n] for n in ("int8", "fp8_e4m3", "fp8_e5m2")} == {
        n: s[0] for n, s in STORAGE.items()}
    for name, (dtype, *_) in STORAGE.items():
        assert is_quantized(dtype), name
        assert kv_head_dim(jnp.zeros((1, 2, 1, 2, 4, 36), dtype)) == 32
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert not is_quantized(dtype)
        pool = jnp.ones((1, 2, 1, 2, 4, 36), dtype)
        assert kv_head_dim(pool) == 36
        out = dequantize_kv(pool)
        assert out.dtype == jnp.float32 and out.shape == pool.shape


@pytest.mark.parametrize("head_dim", [64, 72])
def test_kv_rotation_is_orthonormal_and_chosen_per_dtype(head_dim):
    r = kv_rotation(jnp.int8, head_dim)
    assert r.shape == (head_dim, head_dim) and r.dtype == np.float32
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-5)
    np.testing.assert_array_equal(r, kv_rotation(jnp.float8_e5m2, head_dim))  # deterministic
    for dtype in (jnp.float8_e4m3fn, jnp.float32, jnp.bfloat16):
        assert kv_rotation(dtype, head_dim) is None


@pytest.mark.parametrize("name", ["int8", "fp8_e5m2"])
def test_rotation_cuts_qk_error_on_keys_with_outlier_channels(name):
    """LLM keys carry a few large channels; quantized rotated, Q.K comes back closer."""
    dtype, d = KV_CACHE_STORAGE[name], 64
    rng = np.random.RandomState(0)
    k = rng.randn(256, d).astype(np.float32)
    k[:, [3, 17]] *= 30.0  # outlier channels shared by every key and query
    q = rng.randn(8, d).astype(np.float32)
    q[:, [3, 17]] *= 5.0
    exact = q @ k.T
    r = kv_rotation(dtype, d)
    plain = q @ np.asarray(dequantize_kv(quantize_kv(jnp.asarray(k), dtype))).T
    rotated = (q @ r) @ np.asarray(dequantize_kv(quantize_kv(jnp.asarray(k @ r), dtype))).T
    err = lambda s: np.sqrt(np.mean((s - exact) ** 2))
    assert err(rotated) < 0.7 * err(plain), (err(rotated), err(plain))
    np.testing.assert_allclose((q @ r) @ (k @ r).T, exact, rtol=1e-4, atol=1e-2)


# ---------------------------------------------------------------- attention over 8-bit pools

G8 = Geometry(8, 2, 2, 32, num_pages=24, width=8)
G16 = Geometry(16, 1, 4, 64, num_pages=16, width=4)
CASES = [("int8", G8), ("fp8_e4m3", G16), ("fp8_e5m2", G8)]
# NOTE: each case compiles every path again. Every path reads 8-bit rows through the one
# `dequantize_kv` (a convert and a scale for each dtype), so the default tier runs int8 and
# fp8_e4m3; fp8_e5m2 (its codec: the tests above and test_kv_write_into_8bit_pool) runs
# the attention paths in the slow tier.
ATTENTION_CASES = slow_except(CASES, 0, 1)
CASE_IDS = [f"{n}-{g}" for n, g in CASES]
# (q_lens, kv_lens, window) of 4 requests on 32 token slots: decode rows beside chunks with
# a prefix, mid-page ends; decode rows first, then a fresh prompt and a padded request.
BATCHES = [([1, 9, 1, 12], [20, 14, 40, 31], 0), ([1, 1, 17, 0], [40, 7, 17, 0], 5)]


def quant_pool(g: Geometry, kv_lens, name: str, seed=0, nudge=True):
    """An 8-bit pool whose owned pages hold random rows (encoded by numpy), poisoned elsewhere.

    Pages nobody owns (and the null page 0) hold the largest code in every value and, as
    scale bytes, 0xFF (a NaN float32) in even pages and 0x7F (3.4e38: the values decode to
    inf) in odd ones.

    Returns:
        (pool dtype[...], oracle f32[...], block_tables): the oracle is the pool decoded by
        numpy alone, with NaN in every page nobody owns.
    """
    dtype, qmax = STORAGE[name][:2]
    rng = np.random.default_rng(seed)
    d = g.head_dim
    shape = (g.num_layers, 2, g.num_kv_heads, g.num_pages, g.page_size, d + 4)
    top = np.array([qmax], np.float32).astype(dtype).view(np.uint8)[0]
    raw = np.full(shape, top, np.uint8)
    raw[..., d:] = 0xFF
    raw[:, :, :, 1::2, :, d:] = 0x7F
    values = _encode(_rows(shape[:-1] + (d,), seed, 0.5), name, nudge)
    tables = np.zeros((len(kv_lens), g.width), np.int32)
    free = list(rng.permutation(np.arange(1, g.num_pages)))
    owned = []
    for i, n in enumerate(kv_lens):
        pages = [free.pop() for _ in range(cdiv(n, g.page_size))]
        tables[i, :len(pages)] = pages
        owned += pages
    raw[:, :, :, owned] = values[:, :, :, owned]
    rows = raw.view(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        oracle = _codes_f32(rows) * _scale_bytes(rows)[..., None]
    assert not np.isfinite(oracle[:, :, :, free + [0]]).any(), "the poison must decode badly"
    oracle[:, :, :, free + [0]] = np.nan
    np.testing.assert_array_equal(np.asarray(dequantize_kv(jnp.asarray(rows)))[:, :, :, owned],
                                  oracle[:, :, :, owned])
    return jnp.asarray(rows), jnp.asarray(oracle), jnp.asarray(tables)


ragged_reference = jax.jit(ragged_paged_attention_reference,
                           static_argnames=("sm_scale", "soft_cap"))
decode_reference = jax.jit(paged_decode_attention_reference,
                           static_argnames=("sm_scale", "soft_cap"))
# Small key blocks: several loop iterations in every part of the XLA path that reads pages
# (one decode group: more of them cost compile time, not coverage).
xla_path = jax.jit(functools.partial(ragged_paged_attention_xla, block_kv=16, block_q=8,
                                     block_q_short=4, decode_block_kv=16,
                                     decode_rows=4), static_argnames=("sm_scale", "soft_cap"))
ragged_kernel = functools.partial(ragged_paged_attention_kernel, block_q=8, pages_per_block=2,
                                  interpret=True)
decode_kernel = functools.partial(paged_decode_attention_kernel, pages_per_block=1,
                                  num_splits=2, interpret=True)


@pytest.mark.parametrize("name,g", ATTENTION_CASES, ids=CASE_IDS)
def test_ragged_paths_on_8bit_pool_match_float32_oracle(name, g):
    for batch, (q_lens, kv_lens, window) in enumerate(BATCHES):
        pool, oracle, tables = quant_pool(g, kv_lens, name, seed=batch)
        md = make_metadata(g, q_lens, kv_lens, tables)
        q = jnp.asarray(np.random.default_rng(10 + batch).standard_normal(
            (g.num_tokens, g.num_q_heads, g.head_dim)), jnp.float32)
        common = dict(sm_scale=SM_SCALE, sliding_window=window)
        want = np.asarray(ragged_reference(q, oracle, 1, md, **common))
        assert np.isfinite(want).all()
        padded = int(np.asarray(md.cu_q_lens)[-1])
        for path, fn in [("reference", ragged_reference), ("xla", xla_path),
                         ("pallas", ragged_kernel)]:
            got = np.asarray(fn(q, pool, 1, md, **common))
            assert got.dtype == np.float32 and np.isfinite(got).all(), path
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=path)
            assert not got[padded:].any(), f"{path}: padded tokens must produce zeros"


# NOTE: the decode kernel reads pages with the ragged Pallas kernel's `load_pages`, which
# runs fp8_e4m3 above: int8 alone in the default tier.
@pytest.mark.parametrize("name,g", slow_except(CASES, 0), ids=CASE_IDS)
def test_decode_kernel_on_8bit_pool_matches_float32_oracle(name, g):
    q_lens, kv_lens, _ = BATCHES[0]
    pool, oracle, tables = quant_pool(g, kv_lens, name, seed=3)
    kv_lens = [20, 0, 40, 31]  # request 1 padded (its pages stay owned, nothing is read)
    md = make_metadata(g, [1 if k else 0 for k in kv_lens], kv_lens, tables,
                       decode_only=True)
    q = jnp.asarray(np.random.default_rng(4).standard_normal(
        (g.num_seqs, g.num_q_heads, g.head_dim)), jnp.float32)
    for window in (0, 6):
        want = np.asarray(decode_reference(q, oracle, 0, md.block_tables, md.kv_lens,
                                           sm_scale=SM_SCALE, sliding_window=window))
        got = np.asarray(decode_kernel(q, pool, 0, md.block_tables, md.kv_lens,
                                       sm_scale=SM_SCALE, sliding_window=window))
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
        assert not got[1].any(), "a padded request must produce zeros"
        assert np.abs(want[0]).max() > 0.1


def test_tpu_kernel_on_int8_pool_in_interpreter():
    # NOTE: the TPU interpreter takes seconds per call: one tiny case (fp8 pages are refused
    # on TPU by `check_kv_cache_dtype`, so int8 only).
    g = Geometry(8, 2, 3, 64, num_tokens=16, num_seqs=3, width=4, num_pages=16)
    q_lens, kv_lens = [1, 6, 3], [9, 6, 20]
    pool, oracle, tables = quant_pool(g, kv_lens, "int8", seed=5)
    md = make_metadata(g, q_lens, kv_lens, tables)
    q = jnp.asarray(np.random.default_rng(6).standard_normal(
        (g.num_tokens, g.num_q_heads, g.head_dim)), jnp.float32)
    want = np.asarray(ragged_reference(q, oracle, 1, md, sm_scale=SM_SCALE, sliding_window=4))
    got = np.asarray(ragged_paged_attention_tpu(q, pool, 1, md, sm_scale=SM_SCALE,
                                                sliding_window=4, block_q=8,
                                                pages_per_block=2, interpret=True))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- KV write


def _write_inputs(name, page_size=8, num_kv_heads=2, head_dim=32, seed=7):
    dtype = STORAGE[name][0]
    num_layers, num_pages, num_tokens = 2, 12, page_size + 4
    shape = (num_layers, 2, num_kv_heads, num_pages, page_size, head_dim)
    pool = quantize_kv(jnp.asarray(_rows(shape, seed)), dtype)
    # A chunk from mid-page into a non-adjacent page, a decode token in the last slot of a
    # page, then padding (slot 0: the null page) for the rest.
    slots = [5 * page_size + 3 + i for i in range(page_size - 3)]
    slots += [9 * page_size, 9 * page_size + 1, 3 * page_size - 1]
    slots += [0] * (num_tokens - len(slots))
    k = _rows((num_tokens, num_kv_heads, head_dim), seed + 1)
    v = _rows((num_tokens, num_kv_heads, head_dim), seed + 2)
    return pool, jnp.asarray(k), jnp.asarray(v), np.asarray(slots, np.int32)


# NOTE: fp8_e4m3 writes as fp8_e5m2 does (power-of-two scales, codes by a convert), whose
# NaN-code bytes are the hazard a copy could rewrite: e4m3 in the slow tier.
@pytest.mark.parametrize("name", slow_except(list(STORAGE), 0, 2))
def test_kv_write_into_8bit_pool(name):
    dtype, qmax, bits, sub = STORAGE[name]
    pool, k, v, slots = _write_inputs(name)
    before = np.asarray(pool).view(np.uint8)
    want = write_kv_reference(pool, 1, k, v, jnp.asarray(slots))
    got = write_kv_kernel(jnp.array(pool), 1, k, v, jnp.asarray(slots), interpret=True)
    assert got.dtype == want.dtype == pool.dtype and got.shape == pool.shape
    got_b, want_b = np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
    np.testing.assert_array_equal(got_b, want_b)  # bit-identical pools

    page_size = pool.shape[4]
    real = slots >= page_size
    pages, offsets = slots[real] // page_size, slots[real] % page_size
    touched = np.zeros(before.shape[:-1], bool)
    touched[1, :, :, pages, offsets] = True
    np.testing.assert_array_equal(want_b[~touched], before[~touched])  # padding wrote nothing
    assert (want_b[touched] != before[touched]).any()

    written = np.asarray(want)[1][:, :, pages, offsets].transpose(0, 2, 1, 3)  # [2, t, H, D+4]
    scale = _scale_bytes(written).astype(np.float64)[..., None]
    for i, x in enumerate((np.asarray(k)[real], np.asarray(v)[real])):
        want_scale = _want_scale(x, name)
        ok = np.ones(want_scale.shape, bool)
        np.testing.assert_allclose(scale[i, ..., 0], want_scale, rtol=2.0 ** -22)
        err = np.abs(np.asarray(dequantize_kv(written[i]), np.float64) - x)
        if bits is None:
            bound = scale[i] * 0.5 * (1 + 1e-6)
        else:
            bound = (2.0 ** -bits * np.abs(x) + sub * scale[i]) * (1 + 1e-6)
        assert (err <= bound)[ok].all(), float((err - bound)[ok].max())
        assert (err > 0.25 * bound).any()

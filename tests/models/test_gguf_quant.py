"""GGUF quantized blocks decoded to row-form leaves, and the host-side weight quantizers."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from models.loaders.gguf_quant import GGUF_KEPT, decode_gguf_rows
from models.quant import (
    QuantFormat,
    QuantPlan,
    dequantize_rows,
    pack_q4_rows,
    quantize_params,
    quantize_rows,
    to_leaves,
    uniform_plan,
    unpack_q4_rows,
)

FORMATS = [QuantFormat("q8", 32), QuantFormat("q8", 0), QuantFormat("q4", 32)]
F16_EPS = 2.0 ** -11  # unit roundoff of float16 (11-bit significand)
BYTES_PER_BLOCK = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


def _weights(n=6, k=256, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[1] *= 1e-3  # small rows: scales far from 1
    w[2] += 3.0  # rows with an offset: Q4_1's min matters
    return w


def _gguf_rows(type_name: str, raw: np.ndarray, k: int) -> np.ndarray:
    return dequantize_rows(GGUF_KEPT[type_name], decode_gguf_rows(type_name, raw, k))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_python_quantizer_round_trips_exactly(type_name):
    qtype = GGMLQuantizationType[type_name]
    w = _weights()
    raw = gguf_quantize(w, qtype)
    assert raw.shape == (6, 256 // 32 * BYTES_PER_BLOCK[type_name])
    want = gguf_dequantize(raw, qtype)
    got = _gguf_rows(type_name, raw, 256)
    assert got.dtype == np.float32 and got.shape == w.shape
    np.testing.assert_array_equal(got, want)
    # Sanity of the oracle itself: the dequantized weights are close to the originals.
    assert np.abs(want - w).max() < 0.5


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_decoded_leaves_have_the_format_shapes(type_name):
    raw = gguf_quantize(_weights(n=3, k=64), GGMLQuantizationType[type_name])
    rows = decode_gguf_rows(type_name, raw, 64)
    shapes = GGUF_KEPT[type_name].leaf_shapes(64, 3)  # on-device [K.., N]: rows transpose it
    assert set(rows) == set(shapes)
    for name, (shape, dtype) in shapes.items():
        assert rows[name].shape == shape[::-1], name
        assert rows[name].dtype == np.dtype(dtype), name


def _random_q4_k(n: int, superblocks: int, rng, d_values=None, dmin_values=None):
    """Raw Q4_K rows: f16 d and dmin in sane ranges, random 6-bit scales/mins and nibbles."""
    raw = rng.integers(0, 256, (n, superblocks, 144), dtype=np.uint8)
    shape = (n, superblocks)
    d = (rng.uniform(1e-3, 2e-2, shape) if d_values is None else d_values).astype(np.float16)
    dmin = (rng.uniform(1e-3, 2e-2, shape) if dmin_values is None
            else dmin_values).astype(np.float16)
    raw[..., 0:2] = d[..., None].view(np.uint8)
    raw[..., 2:4] = dmin[..., None].view(np.uint8)
    return raw.reshape(n, superblocks * 144)


def test_q4_k_is_exact_when_the_expanded_scales_fit_f16():
    # d and dmin powers of two: d * (6-bit scale) has <= 6 significant bits, exact in f16,
    # so keeping Q4_K as q4 (scales and zeros expanded to f16) loses nothing.
    rng = np.random.default_rng(1)
    shape = (5, 3)
    d = 2.0 ** rng.integers(-10, -4, shape)
    dmin = 2.0 ** rng.integers(-10, -4, shape)
    raw = _random_q4_k(5, 3, rng, d, dmin)
    want = gguf_dequantize(raw, GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(_gguf_rows("Q4_K", raw, 768), want)


def test_q4_k_matches_gguf_within_f16_rounding_of_the_sub_block_scales():
    """Random f16 d and dmin: d * sc and dmin * m (exact in f32) are rounded to f16.

    Bound per value of sub-block (sc, m) with code q <= 15: rounding d * sc costs at most
    F16_EPS * d * sc per unit of q, rounding dmin * m at most F16_EPS * dmin * m, so
    |err| <= F16_EPS * (15 * d * sc + dmin * m), plus one f32 rounding of the result on
    each side (2 ** -24 * |value| each; 2 ** -22 allowed). d * sc >= 1e-3 (or 0), far
    above f16's smallest normal (6.1e-5), so no subnormal rounding enters.
    """
    rng = np.random.default_rng(2)
    raw = _random_q4_k(7, 2, rng)
    want = gguf_dequantize(raw, GGMLQuantizationType.Q4_K)
    got = _gguf_rows("Q4_K", raw, 512)
    # Independent unpacking of the 6-bit scales (ggml's get_scale_min_k4) for the bound.
    blocks = raw.reshape(7, 2, 144)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    sc_bytes = blocks[..., 4:16].astype(np.int64)
    sc, mn = np.zeros((7, 2, 8)), np.zeros((7, 2, 8))
    for j in range(8):
        if j < 4:
            sc[..., j] = sc_bytes[..., j] & 63
            mn[..., j] = sc_bytes[..., j + 4] & 63
        else:
            sc[..., j] = (sc_bytes[..., j + 4] & 0xF) | ((sc_bytes[..., j - 4] >> 6) << 4)
            mn[..., j] = (sc_bytes[..., j + 4] >> 4) | ((sc_bytes[..., j] >> 6) << 4)
    bound = F16_EPS * (15 * d[..., None] * sc + dmin[..., None] * mn)  # [7, 2, 8]
    bound = np.repeat(bound.reshape(7, 16), 32, axis=1) + 2.0 ** -22 * np.abs(want)
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 0, "random d should make some f16 rounding visible"
    # The independently unpacked scales reproduce gguf's result (checks the oracle above).
    q = np.stack([blocks[..., 16:].reshape(7, 2, 4, 32) & 15,
                  blocks[..., 16:].reshape(7, 2, 4, 32) >> 4], axis=3).reshape(7, 2, 8, 32)
    mine = (d[..., None, None] * sc[..., None] * q - dmin[..., None, None] * mn[..., None])
    np.testing.assert_allclose(mine.reshape(7, 512), want, rtol=1e-6, atol=1e-9)


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_path):
    return GGUFReader(smollm2_path)


@pytest.mark.parametrize("name,type_name,rows", [("blk.0.attn_q.weight", "Q4_1", None),
                                                  ("token_embd.weight", "Q8_0", 1024)])
def test_default_model_tensors_decode_exactly(smollm2_reader, name, type_name, rows):
    (t,) = [t for t in smollm2_reader.tensors if t.name == name]
    assert t.tensor_type.name == type_name
    raw = np.asarray(t.data)[:rows]  # the embedding: its first rows (all of it is 30 MB)
    k = int(t.shape[0])
    want = gguf_dequantize(raw, t.tensor_type)
    got = _gguf_rows(type_name, raw, k)
    assert got.shape == want.shape == (raw.shape[0], k)
    np.testing.assert_array_equal(got, want)


def test_wrong_row_size_raises():
    raw = gguf_quantize(_weights(n=3, k=64), GGMLQuantizationType.Q4_1)  # 40 bytes per row
    with pytest.raises(ValueError, match=r"Q4_1 row of 64 values needs 40 bytes, got 39"):
        decode_gguf_rows("Q4_1", raw[:, :39], 64)
    with pytest.raises(ValueError, match=r"Q4_1 row of 96 values needs 60 bytes, got 40"):
        decode_gguf_rows("Q4_1", raw, 96)
    with pytest.raises(ValueError, match=r"Q4_K row of 64 values"):  # not a super-block
        decode_gguf_rows("Q4_K", raw, 64)


@pytest.mark.parametrize("type_name", ["Q6_K", "F16", "q8_0"])
def test_unsupported_type_raises(type_name):
    raw = np.zeros((2, 34), np.uint8)
    with pytest.raises(ValueError, match=rf"GGUF type {type_name} cannot stay quantized; "
                                         r"kept types: Q8_0, Q4_0, Q4_1, Q4_K"):
        decode_gguf_rows(type_name, raw, 32)


def test_pack_q4_byte_order_and_round_trip():
    rng = np.random.default_rng(3)
    values = rng.integers(0, 16, (3, 96), dtype=np.uint8)
    packed = pack_q4_rows(values)
    assert packed.shape == (3, 48) and packed.dtype == np.uint8
    for b in range(3):  # block b: byte b*16 + j = value b*32 + j | value b*32 + 16 + j << 4
        for j in range(16):
            want = values[:, b * 32 + j] + 16 * values[:, b * 32 + 16 + j]
            np.testing.assert_array_equal(packed[:, b * 16 + j], want)
    np.testing.assert_array_equal(unpack_q4_rows(packed), values)
    any_bytes = rng.integers(0, 256, (4, 32), dtype=np.uint8)
    np.testing.assert_array_equal(pack_q4_rows(unpack_q4_rows(any_bytes)), any_bytes)


def test_q4_byte_order_is_gguf_q4_0s():
    # gguf's Q4_0 block: f16 d, then the 16 bytes in the same order pack_q4_rows writes.
    w = _weights(n=3, k=64)
    raw = gguf_quantize(w, GGMLQuantizationType.Q4_0).reshape(3, 2, 18)
    codes = np.rint(gguf_dequantize(raw.reshape(3, 36), GGMLQuantizationType.Q4_0)
                    .reshape(3, 2, 32) / raw[..., :2].copy().view(np.float16)
                    .astype(np.float32) + 8).astype(np.uint8).reshape(3, 64)
    np.testing.assert_array_equal(pack_q4_rows(codes), raw[..., 2:].reshape(3, 32))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.kind}-{f.block}")
def test_quantize_rows_error_bounds(fmt):
    w = _weights(n=5, k=96, seed=4)
    rows = quantize_rows(fmt, w)
    shapes = fmt.leaf_shapes(96, 5)
    assert {n: (a.shape[::-1], a.dtype.name) for n, a in rows.items()} == shapes
    got = dequantize_rows(fmt, rows)
    block = fmt.block_for(96)
    scale = rows["scales"].astype(np.float64)  # [N, K // block]
    err = np.abs(got.astype(np.float64) - w).reshape(5, 96 // block, block)
    if fmt.kind == "q8":
        bound = scale * (0.5 + 1e-6)  # rint error; the clip at 127 costs < 127 * F16_EPS
        np.testing.assert_array_equal(rows["scales"],
                                      (np.abs(w).reshape(5, -1, block).max(-1) / 127)
                                      .astype(np.float16))
    else:
        zero = rows["zeros"].astype(np.float64)
        # rint error, plus the f16 rounding of the min and of (max - min) / 15 (the clip at
        # 0 or 15 then costs at most that much more).
        bound = scale / 2 + 1.01 * F16_EPS * (np.abs(zero) + 15 * scale) + 1e-6
        np.testing.assert_array_equal(rows["zeros"],
                                      w.reshape(5, -1, block).min(-1).astype(np.float16))
    assert (err <= bound[..., None]).all(), float((err - bound[..., None]).max())
    # Tight: some value is off by more than a quarter of its block's step.
    assert (err > 0.25 * scale[..., None]).any()


def test_q4_scales_and_mins_equal_gguf_q4_1s():
    w = _weights(n=4, k=64, seed=5)
    rows = quantize_rows(QuantFormat("q4", 32), w)
    gguf_rows = decode_gguf_rows("Q4_1", gguf_quantize(w, GGMLQuantizationType.Q4_1), 64)
    np.testing.assert_array_equal(rows["scales"], gguf_rows["scales"])
    np.testing.assert_array_equal(rows["zeros"], gguf_rows["zeros"])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.kind}-{f.block}")
def test_zero_and_constant_blocks(fmt):
    w = _weights(n=3, k=64, seed=6)
    w[0] = 0.0  # every block of row 0 is zero
    w[1, :32] = 0.75  # a constant block (q4: max == min)
    rows = quantize_rows(fmt, w)
    assert all(np.isfinite(a.astype(np.float32)).all() for a in rows.values())
    got = dequantize_rows(fmt, rows)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[0], 0.0)
    q = unpack_q4_rows(rows["qweight"]) if fmt.kind == "q4" else rows["qweight"]
    np.testing.assert_array_equal(q[0], 0)
    np.testing.assert_array_equal(rows["scales"][0], 0)
    if fmt.kind == "q4":
        np.testing.assert_array_equal(rows["zeros"][0], 0)
        np.testing.assert_array_equal(got[1, :32], 0.75)  # exactly the f16 min
    elif fmt.block == 32:
        np.testing.assert_array_equal(q[1, :32], 127)
        np.testing.assert_allclose(got[1, :32], 0.75, rtol=F16_EPS)


def test_leaf_shapes_and_block_errors():
    assert QuantFormat("q8", 0).leaf_shapes(96, 8) == {
        "qweight": ((96, 8), "int8"), "scales": ((1, 8), "float16")}
    assert QuantFormat("q4").leaf_shapes(64, 8) == {
        "qweight": ((32, 8), "uint8"), "scales": ((2, 8), "float16"),
        "zeros": ((2, 8), "float16")}
    with pytest.raises(ValueError, match="q8 block 32 does not divide the input size 48"):
        QuantFormat("q8", 32).leaf_shapes(48, 8)
    assert (QuantFormat("q8").bits, QuantFormat("q4").bits) == (8, 4)


def test_to_leaves_transposes_every_leaf():
    rows = quantize_rows(QuantFormat("q4", 32), _weights(n=3, k=64))
    leaves = to_leaves(rows)
    for name in rows:
        np.testing.assert_array_equal(leaves[name], rows[name].T)
        assert leaves[name].flags["C_CONTIGUOUS"]


def test_quant_plan_round_trip_and_lookup():
    plan = QuantPlan((("q_proj", QuantFormat("q4", 32)), ("lm_head", QuantFormat("q8", 0))),
                     "gguf")
    assert plan.get("q_proj") == QuantFormat("q4", 32) and plan.get("o_proj") is None
    assert QuantPlan.from_dict(plan.to_dict()) == plan
    assert hash(QuantPlan.from_dict(plan.to_dict())) == hash(plan)
    assert plan and not QuantPlan()
    uniform = uniform_plan("int8", QuantFormat("q8", 0), ("q_proj", "k_proj"))
    assert uniform.to_dict() == {"name": "int8",
                                 "formats": {"q_proj": ["q8", 0], "k_proj": ["q8", 0]}}


def test_quantize_params_converts_only_planned_modules():
    rng = np.random.default_rng(7)
    q_kernel = rng.standard_normal((2, 64, 32)).astype(np.float32)  # stacked [L, in, out]
    bias = rng.standard_normal((2, 32)).astype(np.float32)
    o_kernel = rng.standard_normal((2, 32, 64)).astype(np.float32)
    embedding = rng.standard_normal((40, 64)).astype(np.float32)  # [vocab, hidden]
    norm = rng.standard_normal(64).astype(np.float32)
    params = {"embed_tokens": {"embedding": embedding},
              "layers": {"q_proj": {"kernel": q_kernel, "bias": bias},
                         "o_proj": {"kernel": o_kernel}, "norm": {"scale": norm}}}
    q4, q8 = QuantFormat("q4", 32), QuantFormat("q8", 32)
    plan = QuantPlan((("q_proj", q4), ("embed_tokens", q8)), "test")
    out = quantize_params(params, plan)

    assert out["layers"]["o_proj"]["kernel"] is o_kernel  # not planned: untouched
    assert out["layers"]["norm"]["scale"] is norm
    q = out["layers"]["q_proj"]
    assert q["bias"] is bias
    assert {n: a.shape for n, a in q.items() if n != "bias"} == {
        n: (2, *s) for n, (s, _) in q4.leaf_shapes(64, 32).items()}
    for layer in range(2):
        leaves = {n: q[n][layer] for n in ("qweight", "scales", "zeros")}
        want = to_leaves(quantize_rows(q4, q_kernel[layer].T))  # rows are [out, in]
        assert set(want) == set(leaves)
        for name in want:
            np.testing.assert_array_equal(leaves[name], want[name])
        w = dequantize_rows(q4, {n: a.T for n, a in leaves.items()}).T  # [in, out]
        np.testing.assert_allclose(w, q_kernel[layer], atol=0.3)
    e = out["embed_tokens"]
    assert {n: a.shape for n, a in e.items()} == {
        n: s for n, (s, _) in q8.leaf_shapes(64, 40).items()}  # [hidden, vocab]
    table = dequantize_rows(q8, {n: a.T for n, a in e.items()})  # [vocab, hidden]
    np.testing.assert_allclose(table, embedding, atol=np.abs(embedding).max() / 127)

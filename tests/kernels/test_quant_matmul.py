"""Quantized matmul: the jnp reference against numpy, the XLA path and the Pallas kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quant import QuantFormat, dequantize_rows, quantize_rows, to_leaves, unpack_q4_rows
from pallas_kernels import quant_embed, quant_matmul
from pallas_kernels.quant_matmul.kernel import quant_matmul_kernel
from pallas_kernels.quant_matmul.reference import dequantize, quant_matmul_reference
from pallas_kernels.quant_matmul.xla import quant_matmul_xla
from tests.kernels.cases import slow_except

FORMATS = {"q8-32": QuantFormat("q8", 32), "q8-channel": QuantFormat("q8", 0),
           "q4-32": QuantFormat("q4", 32)}
# (M, K, N): together every M in {1, 5, 33}, K in {64, 96}, N in {32, 48}.
SHAPES = [(1, 64, 32), (5, 96, 48), (33, 64, 48)]

reference = jax.jit(quant_matmul_reference, static_argnames=("kind",))
xla_path = jax.jit(quant_matmul_xla, static_argnames=("kind",))
kernel = functools.partial(quant_matmul_kernel, interpret=True)


@functools.cache
def weight(fmt_name: str, k: int, n: int, seed: int = 0):
    """(row-form leaves as numpy, on-device leaves as jnp) of a random [N, K] weight."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[: n // 4] += 1.5  # some columns with an offset (q4's zero point matters)
    rows = quantize_rows(FORMATS[fmt_name], w)
    return rows, {name: jnp.asarray(a) for name, a in to_leaves(rows).items()}


def activations(m: int, k: int, seed: int = 1, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


# NOTE: the shape changes no code (K 96 runs in test_xla_and_kernel_match_reference).
@pytest.mark.parametrize("k,n", slow_except([(64, 32), (96, 48)], 0))
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_reference_dequantize_equals_numpy(fmt_name, k, n):
    rows, leaves = weight(fmt_name, k, n)
    fmt = FORMATS[fmt_name]
    got = np.asarray(dequantize(leaves, fmt.kind))
    want = dequantize_rows(fmt, rows).T  # [K, N]
    assert got.shape == (k, n)
    np.testing.assert_array_equal(got, want)  # every product is exact in f32
    bf16 = dequantize(leaves, fmt.kind, jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16, np.float32),
                                  np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))


def _dense_oracle(fmt_name, x, k, n):
    rows, _ = weight(fmt_name, k, n)
    w = dequantize_rows(FORMATS[fmt_name], rows).astype(np.float64).T  # [K, N]
    xf = np.asarray(x, np.float64)
    return xf @ w, np.abs(xf) @ np.abs(w)


# NOTE: each (format, shape) compiles both paths: the default tier runs every format once
# and every shape once (M 1/5/33: one row tile or three; N 32/48: one column tile or three),
# the other pairings in the slow tier.
@pytest.mark.parametrize("fmt_name,m,k,n", slow_except(
    [(f, *shape) for f in FORMATS for shape in SHAPES], 0, 4, 8), ids=lambda s: str(s))
def test_xla_and_kernel_match_reference(fmt_name, m, k, n):
    _, leaves = weight(fmt_name, k, n)
    kind = FORMATS[fmt_name].kind
    x = activations(m, k)
    want = np.asarray(reference(x, leaves, kind))
    exact, magnitude = _dense_oracle(fmt_name, x, k, n)
    # The reference itself against float64 numpy: f32 accumulation error only.
    assert (np.abs(want - exact) <= 1e-6 * magnitude + 1e-6).all()
    got_xla = np.asarray(xla_path(x, leaves, kind))
    got_kernel = np.asarray(kernel(x, leaves, kind))
    for got in (got_xla, got_kernel):
        assert got.shape == (m, n) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * magnitude.max())


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_xla_path_in_bfloat16(fmt_name):
    """bf16 x: the XLA path dequantizes in bf16 (scales f16 -> bf16: 8-bit significands).

    Bound: each weight value carries 3 bf16 roundings (2^-9 each: the scale, the product,
    the + zero) of terms no larger than |q * scale| + |zero|, and the output one more, so
    |err| <= 4 * 2^-9 * sum_k |x_k| (|q_k * s| + |z|) = 2^-7 * ... when the dot
    accumulates in f32 (XLA's CPU dot does; measured: err / bound <= 0.25).
    """
    m, k, n = 5, 96, 48
    rows, leaves = weight(fmt_name, k, n)
    fmt = FORMATS[fmt_name]
    x = activations(m, k, dtype=jnp.bfloat16)
    got = xla_path(x, leaves, fmt.kind)
    assert got.dtype == jnp.bfloat16
    exact, _ = _dense_oracle(fmt_name, x, k, n)
    scale = np.repeat(rows["scales"].astype(np.float64), k // rows["scales"].shape[1], axis=1)
    codes = rows["qweight"] if fmt.kind == "q8" else unpack_q4_rows(rows["qweight"])
    codes = codes.astype(np.float64)
    terms = np.abs(codes * scale)
    if fmt.kind == "q4":
        terms += np.abs(np.repeat(rows["zeros"].astype(np.float64), 32, axis=1))
    bound = 2.0 ** -7 * (np.abs(np.asarray(x, np.float64)) @ terms.T)
    err = np.abs(np.asarray(got, np.float64) - exact)
    assert (err <= bound).all(), float((err - bound).max())
    # bf16 really is coarser than the f32 path (the test sees the dtype it claims to).
    assert err.max() > 1e-4 * np.abs(exact).max()


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_quant_embed_equals_dense_rows(fmt_name):
    rows, leaves = weight(fmt_name, 64, 48)  # the table: [hidden 64, vocab 48]
    fmt = FORMATS[fmt_name]
    ids = jnp.asarray([0, 47, 3, 3, 20], jnp.int32)  # first, last, a repeat
    dense = dequantize_rows(fmt, rows)  # [vocab, hidden]
    got = quant_embed(leaves, fmt.kind, ids, jnp.float32)
    assert got.shape == (5, 64) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), dense[np.asarray(ids)])
    got16 = quant_embed(leaves, fmt.kind, ids, jnp.bfloat16)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(got16, np.float32),
        np.asarray(jnp.asarray(dense[np.asarray(ids)], jnp.bfloat16), np.float32))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_ops_dispatch_keeps_leading_axes(backend):
    _, leaves = weight("q4-32", 64, 32)
    x = activations(6, 64, seed=2).reshape(2, 3, 64)
    got = np.asarray(quant_matmul(x, leaves, "q4", backend=backend))
    want = np.asarray(reference(x.reshape(6, 64), leaves, "q4")).reshape(2, 3, 32)
    assert got.shape == (2, 3, 32)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_shape_errors_name_the_problem():
    _, q8 = weight("q8-32", 64, 32)
    _, q4 = weight("q4-32", 64, 32)
    x = activations(1, 64)
    bad = {**q8, "scales": q8["scales"][:, :31]}
    with pytest.raises(ValueError, match=r"scales \(2, 31\) do not fit qweight \(64, 32\)"):
        quant_matmul_reference(x, bad, "q8")
    with pytest.raises(ValueError, match=r"scales \(2, 31\) do not fit qweight \(64, 32\)"):
        quant_matmul_xla(x, bad, "q8")
    bad = {**q8, "scales": q8["scales"][:1].repeat(3, axis=0)}  # 3 blocks do not divide 64
    with pytest.raises(ValueError, match=r"scales \(3, 32\) do not fit qweight"):
        kernel(x, bad, "q8")
    bad = {**q4, "scales": q4["scales"].repeat(2, axis=0),
           "zeros": q4["zeros"].repeat(2, axis=0)}  # blocks of 16
    with pytest.raises(ValueError, match=r"q4 qweight \(32, 32\) needs blocks of a multiple "
                                         r"of 32 values; scales \(4, 32\) give blocks of 16"):
        quant_matmul_xla(x, bad, "q4")
    bad = {**q4, "zeros": q4["zeros"][:, :16]}
    with pytest.raises(ValueError, match=r"zeros \(2, 16\) differ from scales \(2, 32\)"):
        kernel(x, bad, "q4")
    with pytest.raises(ValueError, match=r"unknown quantized format 'q2'"):
        dequantize(q8, "q2")
    with pytest.raises(ValueError, match=r"x \(1, 32\) does not match the weight's input "
                                         r"size 64"):
        quant_matmul_xla(x[:, :32], q8, "q8")
    with pytest.raises(ValueError, match=r"x \(1, 32\) must be \[M, 64\] for the weight"):
        kernel(x[:, :32], q8, "q8")
    q8_16 = {"qweight": q8["qweight"], "scales": jnp.ones((4, 32), jnp.float16)}
    with pytest.raises(ValueError, match=r"blocks of a multiple of 32 values; got blocks "
                                         r"of 16"):
        kernel(x, q8_16, "q8")
    np.testing.assert_allclose(np.asarray(quant_matmul_xla(x, q8_16, "q8")),  # XLA: any block
                               np.asarray(x) @ np.asarray(q8["qweight"], np.float32),
                               rtol=1e-6, atol=1e-3)
    q8_48 = {"qweight": q8["qweight"][:48], "scales": jnp.ones((1, 32), jnp.float16)}
    with pytest.raises(ValueError, match=r"K \(48\) to be a multiple of 32"):
        kernel(x[:, :48], q8_48, "q8")


# Checkpoint group sizes (GPTQ/AWQ/compressed-tensors): q4 and q8 blocks of 64 and 128 and
# q4 float32 zeros, through the jnp reference, XLA and the Pallas kernel (interpreted).
@pytest.mark.parametrize("fmt", [QuantFormat("q4", 64), QuantFormat("q4", 128, "float32"),
                                 QuantFormat("q4", 0, "float32"), QuantFormat("q8", 64)],
                         ids=["q4-64", "q4-128-f32zeros", "q4-channel-f32zeros", "q8-64"])
def test_group_blocks_match_the_numpy_dequantization(fmt):
    k, n = 128, 32
    rng = np.random.default_rng(3)
    w = rng.standard_normal((n, k)).astype(np.float32)
    rows = quantize_rows(fmt, w)
    if fmt.zero_dtype == "float32":  # zeros no float16 holds exactly
        rows["zeros"] = rows["zeros"].astype(np.float32) + np.float32(1e-4)
    leaves = {name: jnp.asarray(a) for name, a in to_leaves(rows).items()}
    want = dequantize_rows(fmt, rows).T
    np.testing.assert_array_equal(np.asarray(dequantize(leaves, fmt.kind)), want)
    x = activations(5, k)
    dense = np.asarray(x) @ want
    for got in (xla_path(x, leaves, kind=fmt.kind), kernel(x, leaves, fmt.kind)):
        np.testing.assert_allclose(np.asarray(got), dense, rtol=1e-5, atol=1e-4)


def test_a_q4_block_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError, match="q4 block 48 .* not a multiple of 32"):
        QuantFormat("q4", 48).leaf_shapes(96, 16)
    leaves = {"qweight": jnp.zeros((48, 16), jnp.uint8), "scales": jnp.zeros((2, 16)),
              "zeros": jnp.zeros((2, 16))}
    with pytest.raises(ValueError, match="blocks of a multiple of 32"):
        dequantize(leaves, "q4")

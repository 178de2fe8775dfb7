"""8-bit KV pages: int8 or fp8 values with one float32 scale per token and KV head.

A quantized pool has the storage dtype (int8, float8_e4m3fn or float8_e5m2) and a last
axis of `head_dim + 4`: each token's row of one head holds its `head_dim` codes followed by
the 4 bytes of its float32 scale (x = code * scale, scale = max|x| / the dtype's largest
code; rounded up to a power of two for fp8). Keeping the scale inside the row means every
page operation (copy-on-write, swap, prefix sharing, tensor-parallel sharding on the head
axis) moves scales with their pages unchanged, and a token's scale never changes after
its write, so pages fill one token at a time without re-quantizing what they hold.

int8 and fp8_e5m2 pages hold K and V rotated by an orthonormal matrix over head_dim
(`kv_rotation`, applied by the model around the attention call): Q.K and the attention
output are unchanged in exact arithmetic, but the rotation spreads the few large channels
of LLM keys over all of them, so a row's scale fits its values better and the rounding
errors of the shared outlier channels stop dominating Q.K. Measured on the default model
(teacher-forced KL to float32 KV, 192 tokens): int8 0.00076 -> 0.00032, fp8_e5m2
0.0217 -> 0.0169 (perplexity +2.9% -> +1.1%); fp8_e4m3 got worse (0.0052 -> 0.0081), so
its pages are not rotated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

SCALE_BYTES = 4
# kv_cache_dtype -> storage dtype ("fp8" is vLLM's alias of e4m3).
KV_CACHE_STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn,
                    "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
_QMAX = {np.dtype(jnp.int8): 127.0, np.dtype(jnp.float8_e4m3fn): 448.0,
         np.dtype(jnp.float8_e5m2): 57344.0}


# Storage dtypes whose pages hold rotated K/V (measured above).
_ROTATED = (np.dtype(jnp.int8), np.dtype(jnp.float8_e5m2))


@functools.lru_cache(maxsize=16)
def kv_rotation(dtype, head_dim: int) -> np.ndarray | None:
    """f32[head_dim, head_dim] orthonormal R that K, V and Q are multiplied by (x @ R) for
    a pool of `dtype`, or None where pages hold K/V as they are. Attention output comes back
    rotated too: multiply it by R.T.

    A normalized Hadamard matrix for power-of-two head_dim; otherwise a fixed seeded random
    orthogonal matrix (the same on every host and run). Computed once per (dtype,
    head_dim), and read-only.
    """
    if np.dtype(dtype) not in _ROTATED:
        return None
    if head_dim & (head_dim - 1) == 0:
        r = np.ones((1, 1), np.float64)
        while r.shape[0] < head_dim:
            r = np.block([[r, r], [r, -r]])
        rot = (r / np.sqrt(head_dim)).astype(np.float32)
    else:
        q, rr = np.linalg.qr(np.random.RandomState(0).randn(head_dim, head_dim))
        rot = (q * np.sign(np.diag(rr))).astype(np.float32)
    rot.setflags(write=False)
    return rot


def is_quantized(dtype) -> bool:
    """Whether a pool of this dtype holds 8-bit codes with in-row scales."""
    return np.dtype(dtype) in _QMAX


def kv_head_dim(kv_pages) -> int:
    """The model's head_dim for a pool (the last axis, less the scale bytes if quantized)."""
    return kv_pages.shape[-1] - (SCALE_BYTES if is_quantized(kv_pages.dtype) else 0)


def quantize_kv(x: jax.Array, dtype) -> jax.Array:
    """f32-able [..., D] -> dtype[..., D + 4]: codes, then the row's scale bytes."""
    dtype = np.dtype(dtype)
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / _QMAX[dtype]  # f32[..., 1]
    scale = jnp.where(scale > 0, scale, 1.0)
    if dtype != np.dtype(jnp.int8):
        # NOTE: fp8 scales are powers of two. For a float code that costs no precision (it
        # shifts exponents), and the scale's bytes (0x00 or 0x80 below the exponent byte)
        # are then never fp8 NaN codes: XLA's CPU backend rewrites every e5m2 NaN to one
        # canonical byte whenever it moves fp8 data, which corrupted arbitrary scales.
        mant, exp = jnp.frexp(scale)  # scale = mant * 2**exp, mant in [0.5, 1)
        exp = jnp.where(mant == 0.5, exp - 1, exp)  # already a power of two
        # 2**exp built from its bits: XLA's exp2 on the CPU is not exact.
        scale = jax.lax.bitcast_convert_type((exp + 127) << 23, jnp.float32)
    scaled = x / scale
    if dtype == np.dtype(jnp.int8):
        codes = jnp.clip(jnp.round(scaled), -127, 127).astype(dtype)
    else:
        codes = scaled.astype(dtype)
    scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], jnp.uint8)  # u8[..., 4]
    return jnp.concatenate([codes, jax.lax.bitcast_convert_type(scale_bytes, dtype)], axis=-1)


def _scale_of(tail: jax.Array) -> jax.Array:
    """f32[...] scale from the 4 stored bytes tail [..., 4] (little-endian, as written)."""
    b = jax.lax.bitcast_convert_type(tail, jnp.uint8).astype(jnp.uint32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return jax.lax.bitcast_convert_type(word, jnp.float32)


def dequantize_kv(rows: jax.Array) -> jax.Array:
    """dtype[..., D + 4] -> f32[..., D]; pools that are not quantized are cast to f32."""
    if not is_quantized(rows.dtype):
        return rows.astype(jnp.float32)
    d = rows.shape[-1] - SCALE_BYTES
    return rows[..., :d].astype(jnp.float32) * _scale_of(rows[..., d:])[..., None]


def pack_for_pool(kv_pages: jax.Array, k: jax.Array, v: jax.Array):
    """This step's K and V as the pool stores them (quantized rows for an 8-bit pool)."""
    if is_quantized(kv_pages.dtype) and k.shape[-1] == kv_head_dim(kv_pages):
        return quantize_kv(k, kv_pages.dtype), quantize_kv(v, kv_pages.dtype)
    return k, v


# kv_cache_dtype -> float pages of that dtype (no scales).
KV_CACHE_FLOATS = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def kv_pool_layout(shape: tuple[int, ...], model_dtype, kv_cache_dtype: str):
    """(shape, dtype) of a page pool whose unquantized shape is `shape`.

    Args:
        shape: [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim].
        model_dtype: The dtype "auto" stores (`Model.kv_dtype`).
        kv_cache_dtype: "auto", "float32", "float16", "bfloat16", "int8", "fp8",
            "fp8_e4m3" or "fp8_e5m2".
    """
    if kv_cache_dtype == "auto":
        return tuple(shape), np.dtype(model_dtype)
    if kv_cache_dtype in KV_CACHE_FLOATS:
        return tuple(shape), np.dtype(KV_CACHE_FLOATS[kv_cache_dtype])
    return (*shape[:-1], shape[-1] + SCALE_BYTES), np.dtype(KV_CACHE_STORAGE[kv_cache_dtype])


def check_kv_cache_dtype(kv_cache_dtype: str, backend: str, model_dtype=None) -> None:
    """Refuses KV pages the attention kernels cannot read.

    Raises:
        ValueError: fp8 with the Pallas kernels on a GPU without fp8 conversions (compute
            capability below 8.9) or on a TPU (its kernel is not built for fp8 pages); float
            pages of another dtype than `model_dtype` with the Pallas kernels (they read
            the queries' dtype; the XLA and `cpu` paths widen any float page).
    """
    if (kv_cache_dtype in KV_CACHE_FLOATS and backend == "pallas" and model_dtype is not None
            and np.dtype(KV_CACHE_FLOATS[kv_cache_dtype]) != np.dtype(model_dtype)):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} with the Pallas attention "
                         f"kernels, which read pages of the model dtype "
                         f"({np.dtype(model_dtype).name}); use kv_cache_dtype='auto' or "
                         "attention_backend='xla'")
    if not kv_cache_dtype.startswith("fp8") or backend != "pallas":
        return
    platform = jax.default_backend()
    if platform == "tpu":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the TPU "
                         "Pallas kernel; use kv_cache_dtype='int8' or attention_backend='xla'")
    if platform == "gpu":
        cc = getattr(jax.devices()[0], "compute_capability", "0")
        if tuple(int(x) for x in str(cc).split(".")[:2]) < (8, 9):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs fp8 conversions "
                             f"(GPU compute capability 8.9+, this one has {cc}); use "
                             "kv_cache_dtype='int8'")

"""The JAX side of the CPU decode kernel: availability, registration and the call itself."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxserve_paged_decode_cpu"


@functools.cache
def _registered() -> str | None:
    """Builds and registers the FFI target once per process; None, or why it failed."""
    from pallas_kernels.cpu_ffi.build import SOURCE, register

    return register(SOURCE, "PagedDecode", TARGET, "the CPU decode kernel",
                    "decode rows use the XLA path")


def available() -> bool:
    """Whether the kernel could be built and registered here (builds it on first call)."""
    return jax.default_backend() == "cpu" and _registered() is None


def unavailable_reason() -> str:
    """Why the kernel is unavailable ("" when it is available)."""
    if jax.default_backend() != "cpu":
        return f"the default platform is {jax.default_backend()}, not the CPU"
    return _registered() or ""


# Page dtypes the kernel reads (8-bit pools with in-row scales go to the XLA path).
PAGE_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def supports(kv_pages: jax.Array) -> bool:
    """Whether the kernel reads this pool: float32 pages, or float16 or bfloat16 ones of
    head_dim at most 256 (the kernel widens a row into a buffer of that size)."""
    dtype = np.dtype(kv_pages.dtype)
    return kv_pages.ndim == 6 and dtype in PAGE_DTYPES and (
        dtype == np.float32 or kv_pages.shape[-1] <= 256)


def paged_decode_cpu(q, kv_pages, layer, block_tables, lens, window, *, sm_scale: float,
                     soft_cap: float | None = None):
    """Online-softmax state of each row's one query over positions [max(0, len - window),
    len) of its pages, read in place.

    Args:
        q: f32[n, kv_heads, group, head_dim]; row i's query sits at position lens[i] - 1.
        kv_pages: f32, f16 or bf16[num_layers, 2, kv_heads, num_pages, page_size,
            head_dim] (16-bit pages: head_dim at most 256).
        layer: Layer index (may be traced).
        block_tables: i32[n, width] pages of each row.
        lens: i32[n] keys each row reads (0: none; the row's state stays empty).
        window: Sliding window (0: none).
        sm_scale: Scale applied to q.k.
        soft_cap: If set, logits become `soft_cap * tanh(logits / soft_cap)`.

    Returns:
        (acc f32[n, k, g, d] unnormalized, m f32[n, k, g], denom f32[n, k, g]).

    Raises:
        ValueError: A soft cap that is not positive.
        RuntimeError: The kernel is unavailable here (see `unavailable_reason`).
    """
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive (or None for no cap), got {soft_cap}")
    if not available():
        raise RuntimeError(f"the CPU decode kernel is unavailable: {unavailable_reason()}")
    n, k, g, d = q.shape
    outs = (jax.ShapeDtypeStruct((n, k, g, d), jnp.float32),
            jax.ShapeDtypeStruct((n, k, g), jnp.float32),
            jax.ShapeDtypeStruct((n, k, g), jnp.float32))
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    call = jax.ffi.ffi_call(TARGET, outs)
    return call(q.astype(jnp.float32), kv_pages, i32(layer).reshape(1), i32(block_tables),
                i32(lens), i32(window).reshape(1), sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(soft_cap or 0.0))

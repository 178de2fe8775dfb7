"""The one interface the model calls for KV writes and attention, dispatching on backend.

Backends: "xla" runs the jnp references (what the CPU uses). "auto" picks per platform.
The Pallas backends (TPU Mosaic, GPU) plug in here when the kernels land.
"""

from __future__ import annotations

import jax

from pallas_kernels.kv_write.reference import write_kv_reference
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

ATTENTION_BACKENDS = ("auto", "xla")


def resolve_backend(backend: str) -> str:
    """Turns "auto" into a concrete backend for the default platform.

    Raises:
        ValueError: If `backend` is not one of `ATTENTION_BACKENDS`.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if backend == "auto":
        return "xla"
    return backend


def write_kv(kv_pages: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             *, backend: str = "xla") -> jax.Array:
    """Scatters new K/V into layer `layer` of the pool; see `write_kv_reference`."""
    del backend  # only the XLA path exists so far
    return write_kv_reference(kv_pages, layer, k, v, slot_mapping)


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, layer, md: AttentionMetadata, *,
                           sm_scale: float, sliding_window=0, soft_cap: float | None = None,
                           backend: str = "xla") -> jax.Array:
    """Packed causal attention through block tables; see `ragged_paged_attention_reference`."""
    del backend
    return ragged_paged_attention_reference(q, kv_pages, layer, md, sm_scale=sm_scale,
                                            sliding_window=sliding_window, soft_cap=soft_cap)

"""Paged-attention kernels (Pallas) and their pure-jnp references, behind one interface."""

from pallas_kernels.metadata import AttentionMetadata, kv_pages_shape
from pallas_kernels.ops import ATTENTION_BACKENDS, ragged_paged_attention, resolve_backend, write_kv

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "kv_pages_shape",
    "ragged_paged_attention",
    "resolve_backend",
    "write_kv",
]

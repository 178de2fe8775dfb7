"""Paged-attention kernels (Pallas) and their pure-jnp references, behind one interface."""

from pallas_kernels.metadata import AttentionMetadata, kv_pages_shape
from pallas_kernels.ops import (
    ATTENTION_BACKENDS,
    quant_matmul,
    ragged_paged_attention,
    resolve_backend,
    write_kv,
)
from pallas_kernels.quant_matmul.reference import quant_embed

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "kv_pages_shape",
    "quant_embed",
    "quant_matmul",
    "ragged_paged_attention",
    "resolve_backend",
    "write_kv",
]

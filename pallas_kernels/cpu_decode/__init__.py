"""Decode attention on the CPU reading pages in place: a C++ XLA FFI call built on first use."""

from pallas_kernels.cpu_decode.op import (
    available,
    paged_decode_cpu,
    supports,
    unavailable_reason,
)

__all__ = ["available", "paged_decode_cpu", "supports", "unavailable_reason"]

"""Small helpers with no dependencies (no JAX), shared by the host-side code."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many units of size `b` (> 0) hold `a` items.

    Works elementwise on NumPy integer arrays as well.
    """
    return -(-a // b)

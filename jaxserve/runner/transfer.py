"""Packs a step's host arrays into one int32 buffer so each step is a single transfer.

`pack` flattens a pytree of NumPy arrays with 4-byte dtypes into one `i32[n]` buffer and a
static layout; `unpack`, inside jit, slices the device buffer back and bitcasts each piece
to its dtype. The layout is hashable, so it can be a static jit argument.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_ALLOWED = ("int32", "uint32", "float32")


class Layout(NamedTuple):
    """Static description of a packed buffer: tree structure, shapes and dtypes."""

    treedef: jax.tree_util.PyTreeDef
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def size(self) -> int:
        """Total int32 words."""
        return sum(int(np.prod(s)) for s in self.shapes)


def pack(tree) -> tuple[np.ndarray, Layout]:
    """Flattens `tree` (NumPy arrays of int32/uint32/float32; bools become int32).

    Raises:
        ValueError: A leaf has another dtype.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts, shapes, dtypes = [], [], []
    for leaf in leaves:
        arr = np.asarray(leaf)
        if arr.dtype == np.bool_:
            arr = arr.astype(np.int32)
        if arr.dtype.name not in _ALLOWED:
            raise ValueError(f"cannot pack dtype {arr.dtype}; allowed: {', '.join(_ALLOWED)}")
        parts.append(np.ascontiguousarray(arr).reshape(-1).view(np.int32))
        shapes.append(arr.shape)
        dtypes.append(arr.dtype.name)
    buf = np.concatenate(parts) if parts else np.zeros(0, np.int32)  # i32[layout.size]
    return buf, Layout(treedef, tuple(shapes), tuple(dtypes))


def unpack(buf: jax.Array, layout: Layout):
    """Inverse of `pack` on device (call inside jit with `layout` static)."""
    leaves, offset = [], 0
    for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
        n = int(np.prod(shape))
        piece = jax.lax.slice(buf, (offset,), (offset + n,))
        if dtype != "int32":
            piece = jax.lax.bitcast_convert_type(piece, jnp.dtype(dtype))
        leaves.append(piece.reshape(shape))
        offset += n
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)

"""Device side of the KV plans: page copies (copy-on-write) and swaps to and from host memory.

Each operation is jitted once per padded pair count (powers of two), with the pool donated,
so plans of any size reuse a few compiled programs. Padding pairs copy the null page onto
itself. Host arrays go to the device with `jax.device_put`: in some JAX versions
`jnp.asarray` of a NumPy array compiles a small program per shape.
"""

from __future__ import annotations

import jax
import numpy as np


def pad_pairs(pairs: np.ndarray, minimum: int = 8) -> np.ndarray:
    """Pads an i32[n, 2] pair list to a power-of-two length with (0, 0) pairs."""
    n = max(minimum, 1 << max(0, len(pairs) - 1).bit_length())
    out = np.zeros((n, 2), np.int32)
    out[:len(pairs)] = pairs
    return out


def _copy_pages(kv_pages, pairs):
    src, dst = pairs[:, 0], pairs[:, 1]
    # kv_pages: [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]
    return kv_pages.at[:, :, :, dst].set(kv_pages[:, :, :, src])


def _gather_pages(kv_pages, page_ids):
    return kv_pages[:, :, :, page_ids]  # [L, 2, Hkv, n, page_size, D]


def _scatter_pages(kv_pages, page_ids, values):
    return kv_pages.at[:, :, :, page_ids].set(values)


copy_pages = jax.jit(_copy_pages, donate_argnums=0)
scatter_pages = jax.jit(_scatter_pages, donate_argnums=0)
gather_pages = jax.jit(_gather_pages)


class HostSwapSpace:
    """Host-memory page slots for preempted requests' KV (NumPy, filled on demand).

    NOTE: slots live in a dict, so host memory grows with what is actually swapped out,
    not with `swap_space`; the KV cache manager enforces the slot count.

    Args:
        num_slots: Page slots (from `swap_space` GiB and the page size in bytes).
        page_shape: Shape of one page across layers: [L, 2, Hkv, page_size, D].
        dtype: NumPy dtype of the pool.
    """

    def __init__(self, num_slots: int, page_shape: tuple[int, ...], dtype):
        self.num_slots = num_slots
        self.page_shape = page_shape
        self.dtype = dtype
        self._slots: dict[int, np.ndarray] = {}

    def swap_out(self, kv_pages, pairs: np.ndarray) -> None:
        """Copies device pages into host slots; pairs are i32[n, 2] (page, slot)."""
        padded = pad_pairs(pairs)
        pages = np.asarray(gather_pages(kv_pages, jax.device_put(padded[:, 0])))
        pages = np.moveaxis(pages, 3, 0)  # [L, 2, Hkv, n, ps, D] -> [n, L, 2, Hkv, ps, D]
        for (_, slot), page in zip(pairs, pages, strict=False):
            self._slots[int(slot)] = page.copy()

    def swap_in(self, kv_pages, pairs: np.ndarray):
        """Writes host slots back into device pages (and frees the slots); pairs are
        i32[n, 2] (slot, page)."""
        padded = pad_pairs(pairs)
        values = np.zeros((len(padded), *self.page_shape), self.dtype)
        for i, (slot, _) in enumerate(pairs):
            values[i] = self._slots.pop(int(slot))
        # Padding rows write zeros into the null page, which is never read unmasked.
        return scatter_pages(kv_pages, jax.device_put(padded[:, 1]),
                             jax.device_put(np.moveaxis(values, 0, 3)))

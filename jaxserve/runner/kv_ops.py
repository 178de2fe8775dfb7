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


def _heads(index: tuple, num_heads: int) -> tuple[int, int]:
    """The KV-head range [first, end) (axis 2) of a shard's index into a page array."""
    return index[2].indices(num_heads)[:2]


class HostSwapSpace:
    """Host-memory page slots for preempted requests' KV (NumPy, filled on demand).

    Each slot holds this process's shards of one page, by KV-head range: with a mesh
    over several processes (hosts) every process keeps the heads it holds, and swapping
    runs in every process on the same plan.

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
        # slot -> {(first head, end head): f[L, 2, heads, page_size, D]}
        self._slots: dict[int, dict[tuple, np.ndarray]] = {}

    def swap_out(self, kv_pages, pairs: np.ndarray) -> None:
        """Copies device pages into host slots; pairs are i32[n, 2] (page, slot)."""
        padded = pad_pairs(pairs)
        pages = gather_pages(kv_pages, jax.device_put(padded[:, 0]))  # [L, 2, Hkv, n, ps, D]
        parts = {}
        for shard in pages.addressable_shards:  # replicas of a head range come once
            parts.setdefault(_heads(shard.index, self.page_shape[2]), shard.data)
        parts = {k: np.asarray(v) for k, v in parts.items()}
        for i, (_, slot) in enumerate(pairs):
            self._slots[int(slot)] = {k: v[:, :, :, i].copy() for k, v in parts.items()}

    def swap_in(self, kv_pages, pairs: np.ndarray):
        """Writes host slots back into device pages (and frees the slots); pairs are
        i32[n, 2] (slot, page)."""
        padded = pad_pairs(pairs)
        slots = [self._slots.pop(int(slot)) for slot, _ in pairs]
        num_heads = self.page_shape[2]
        shape = (*self.page_shape[:3], len(padded), *self.page_shape[3:])

        def local(lo: int, hi: int):  # heads [lo, hi) of the values, f[L, 2, h, n, ps, D]
            out = np.zeros((*shape[:2], hi - lo, *shape[3:]), self.dtype)
            for i, parts in enumerate(slots):
                for (a, b), part in parts.items():
                    first, end = max(a, lo), min(b, hi)
                    if first < end:
                        out[:, :, first - lo:end - lo, i] = part[:, :, first - a:end - a]
            return out

        # Padding rows write zeros into the null page, which is never read unmasked.
        if jax.process_count() == 1:
            # NOTE: an uncommitted array, as warm-up's: a committed one would compile the
            # next model step anew.
            values = jax.device_put(local(0, num_heads))
        else:
            values = jax.make_array_from_callback(
                shape, kv_pages.sharding, lambda index: local(*_heads(index, num_heads)))
        return scatter_pages(kv_pages, jax.device_put(padded[:, 1]), values)

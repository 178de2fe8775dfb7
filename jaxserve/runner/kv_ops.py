"""Device side of the KV plans: page copies (copy-on-write) and swaps to and from host memory.

Each operation is compiled for one pair count, `PLAN_PAIRS`, with the pool donated: a
plan runs in pieces of that many pairs, the last padded with pairs that copy the null page
onto itself. One size per operation keeps warm-up to three small programs (six sizes
each cost ~0.5 s to compile); a large plan costs more dispatches, which are rare (swaps,
copy-on-write) and cheap beside the step. Host arrays go to the device with
`jax.device_put`: in some JAX versions `jnp.asarray` of a NumPy array compiles a small
program per shape.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.core.plans import KVPlans
from jaxserve.runner.state_pool import (
    HostStateSpace,
    cache_pages,
    run_state_plans,
    with_pages,
)

# Pairs of every compiled page-plan program.
PLAN_PAIRS = 8


def pad_pairs(pairs: np.ndarray) -> np.ndarray:
    """Pads an i32[n, 2] pair list (n <= PLAN_PAIRS) to PLAN_PAIRS with (0, 0) pairs."""
    if len(pairs) > PLAN_PAIRS:
        raise ValueError(f"{len(pairs)} page pairs in one piece; at most {PLAN_PAIRS}")
    out = np.zeros((PLAN_PAIRS, 2), np.int32)  # i32[PLAN_PAIRS, 2]
    out[:len(pairs)] = pairs
    return out


def plan_pieces(pairs: np.ndarray) -> list[np.ndarray]:
    """An i32[n, 2] plan in pieces of at most PLAN_PAIRS pairs, in order."""
    return [pairs[i:i + PLAN_PAIRS] for i in range(0, len(pairs), PLAN_PAIRS)]


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


def copy_page_pairs(kv_pages, pairs: np.ndarray):
    """Copies pages (i32[n, 2] (src, dst) pairs, any n) in pieces; returns the new pool."""
    for piece in plan_pieces(pairs):
        kv_pages = copy_pages(kv_pages, jax.device_put(pad_pairs(piece)))
    return kv_pages


def run_plans(kv_pages, swap: HostSwapSpace, plans: KVPlans,
              state_host: HostStateSpace | None = None):
    """Runs a step's plans on the runner's cache: the page plans on its page pool (swap-outs
    first, as their pages may be reused this step, then swap-ins, then copies), and with a
    state group (`kv_pages` a `HybridCache`) the state plans on its state pools
    (`state_pool.run_state_plans`, host rows in `state_host`). Returns the new cache.

    NOTE: plans run in pieces of PLAN_PAIRS pairs (STATE_PAIRS rows), the one size warm-up
    compiled, so a step that swaps or copies many pages compiles nothing.

    Raises:
        ValueError: State plans without a state group, or without `state_host`.
    """
    pages = cache_pages(kv_pages)
    if plans.swap_out.pairs:
        swap.swap_out(pages, plans.swap_out.as_array())
    if plans.swap_in.pairs:
        pages = swap.swap_in(pages, plans.swap_in.as_array())
    if plans.copy.pairs:
        pages = copy_page_pairs(pages, plans.copy.as_array())
    kv_pages = with_pages(kv_pages, pages)
    if not plans.state.is_empty():
        if pages is kv_pages or state_host is None:
            raise ValueError("state plans for a cache without state pools (a model without "
                             "linear-attention layers) or without a host state space")
        kv_pages = run_state_plans(kv_pages, state_host, plans.state)
    return kv_pages


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
        for piece in plan_pieces(pairs):
            pages = gather_pages(kv_pages, jax.device_put(pad_pairs(piece)[:, 0]))
            parts = {}  # [L, 2, Hkv, PLAN_PAIRS, ps, D] by head range
            for shard in pages.addressable_shards:  # replicas of a head range come once
                parts.setdefault(_heads(shard.index, self.page_shape[2]), shard.data)
            parts = {k: np.asarray(v) for k, v in parts.items()}
            for i, (_, slot) in enumerate(piece):
                self._slots[int(slot)] = {k: v[:, :, :, i].copy() for k, v in parts.items()}

    def swap_in(self, kv_pages, pairs: np.ndarray):
        """Writes host slots back into device pages (and frees the slots); pairs are
        i32[n, 2] (slot, page). Returns the new pool."""
        for piece in plan_pieces(pairs):
            kv_pages = self._swap_in_piece(kv_pages, piece)
        return kv_pages

    def _swap_in_piece(self, kv_pages, pairs: np.ndarray):
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

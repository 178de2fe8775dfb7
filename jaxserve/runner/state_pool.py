"""Device side of the state group: the state pools beside the page pool, and the state plans
(swap to host and back, fork copies) run on their rows in fixed-size pieces.

A model with linear-attention layers carries a `models.gated_deltanet.HybridCache` (the page
pool and its state pools, each f[L_lin, num_slots, ...] with the slot on axis 1) where other
models carry the page pool alone; the runner threads either through its steps as its
`kv_pages`. State moves run as the page plans do: one gather program and one scatter program
of `STATE_PAIRS` rows each (the scatter donating the pools), padded with row 0, the null
slot that padded requests read and write (a padded request starts from a zero state, so
what lands there is never read). So warm-up compiles two small programs, and a plan of any
size compiles nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.plans import StatePlans
from models.gated_deltanet import HybridCache

# Rows of every compiled state-plan program (as the page plans' PLAN_PAIRS).
STATE_PAIRS = 8


def cache_pages(cache):
    """The page pool of a runner's cache (a `HybridCache`'s pages, or the pool itself)."""
    return cache.pages if isinstance(cache, HybridCache) else cache


def with_pages(cache, pages):
    """`cache` with its page pool replaced by `pages`."""
    return cache._replace(pages=pages) if isinstance(cache, HybridCache) else pages


def state_arrays(cache) -> tuple:
    """The state pools of a `HybridCache` (conv, recurrent), () for a plain page pool."""
    return (cache.conv, cache.recurrent) if isinstance(cache, HybridCache) else ()


def empty_cache(model, pool_shape: tuple[int, ...], pool_dtype, num_state_slots: int):
    """A zeroed runner cache: the page pool of `pool_shape` and `pool_dtype` (an 8-bit KV
    format widens the rows: `pallas_kernels.kv_quant.kv_pool_layout`) and, for a model with
    linear-attention layers, its state pools of `num_state_slots` slots
    (`Model.empty_cache`'s, the pages built here for the KV format). Call inside jit to
    place it by output shardings.

    Raises:
        ValueError: A model with linear-attention layers and fewer than 2 state slots.
    """
    pages = jnp.zeros(pool_shape, pool_dtype)
    if not model.has_linear_attention:
        return pages
    states = model.empty_cache(1, 1, num_state_slots)  # f32 pools; its one-page pool unused
    return HybridCache(pages, states.conv, states.recurrent)


def cache_shardings(parallel, model):
    """The output shardings of a runner's cache under a tensor-parallel layout: the page
    pool's, and with linear-attention layers a `HybridCache` of it and the state pools'
    (`TensorParallel.state_shardings`: split as the layers' heads)."""
    pages = parallel.kv_pages_sharding()
    if not model.has_linear_attention:
        return pages
    states = parallel.state_shardings()
    return HybridCache(pages, states["conv"], states["recurrent"])


def pad_slots(slots: np.ndarray) -> np.ndarray:
    """Pads i32[n] slot ids (n <= STATE_PAIRS) to STATE_PAIRS with the null slot 0."""
    if len(slots) > STATE_PAIRS:
        raise ValueError(f"{len(slots)} state slots in one piece; at most {STATE_PAIRS}")
    out = np.zeros(STATE_PAIRS, np.int32)  # i32[STATE_PAIRS]
    out[:len(slots)] = slots
    return out


def _gather_rows(states: tuple, slots):
    return tuple(s[:, slots] for s in states)  # each f[L, STATE_PAIRS, ...]


def _scatter_rows(states: tuple, slots, values: tuple):
    return tuple(s.at[:, slots].set(v) for s, v in zip(states, values, strict=True))


gather_rows = jax.jit(_gather_rows)
scatter_rows = jax.jit(_scatter_rows, donate_argnums=0)


def _pieces(pairs: np.ndarray) -> list[np.ndarray]:
    return [pairs[i:i + STATE_PAIRS] for i in range(0, len(pairs), STATE_PAIRS)]


def copy_rows(states: tuple, pairs: np.ndarray) -> tuple:
    """Copies state rows (i32[n, 2] (src, dst) pairs, any n): every piece is gathered before
    any is scattered, since a dst may be another pair's src (a slot given back and handed
    out again in one pass). Returns the new pools."""
    pieces = _pieces(pairs)
    values = [gather_rows(states, jax.device_put(pad_slots(p[:, 0]))) for p in pieces]
    for piece, vals in zip(pieces, values, strict=True):
        states = scatter_rows(states, jax.device_put(pad_slots(piece[:, 1])), vals)
    return states


class HostStateSpace:
    """Host copies of swapped-out requests' states, keyed by host state slot (NumPy, filled
    on demand: host memory grows with what is swapped out; the KV manager counts the slots).

    NOTE: one process only (multi-host engines refuse swap preemption), so the pools' rows
    come back whole whatever their sharding.
    """

    def __init__(self):
        self._rows: dict[int, tuple[np.ndarray, ...]] = {}  # host slot -> each pool's row

    def __len__(self) -> int:
        return len(self._rows)

    def swap_out(self, states: tuple, pairs: np.ndarray) -> None:
        """Copies device rows into host slots; pairs are i32[n, 2] (slot, host slot)."""
        for piece in _pieces(pairs):
            rows = [np.asarray(v) for v in gather_rows(states, jax.device_put(
                pad_slots(piece[:, 0])))]  # each f[L, STATE_PAIRS, ...]
            for i, (_, host) in enumerate(piece):
                self._rows[int(host)] = tuple(r[:, i].copy() for r in rows)

    def swap_in(self, states: tuple, pairs: np.ndarray) -> tuple:
        """Writes host slots back into device rows; pairs are i32[n, 2] (host slot, slot),
        a host slot possibly feeding several rows (a request swapped in, then forked). The
        host slots read are let go afterwards. Returns the new pools."""
        for piece in _pieces(pairs):
            values = tuple(np.zeros((s.shape[0], STATE_PAIRS, *s.shape[2:]), s.dtype)
                           for s in states)  # padding rows write zeros into the null slot
            for i, (host, _) in enumerate(piece):
                for value, row in zip(values, self._rows[int(host)], strict=True):
                    value[:, i] = row
            # NOTE: uncommitted arrays, as warm-up's, so nothing compiles anew.
            states = scatter_rows(states, jax.device_put(pad_slots(piece[:, 1])),
                                  tuple(jax.device_put(v) for v in values))
        for host in {int(h) for h in pairs[:, 0]}:
            del self._rows[host]
        return states


def run_state_plans(cache: HybridCache, host: HostStateSpace, plans: StatePlans
                    ) -> HybridCache:
    """Runs a step's state moves on the cache's state pools in `StatePlans`' order:
    swap-outs, then copies, then swap-ins. Returns the new cache (its pages untouched)."""
    states = state_arrays(cache)
    if plans.swap_out.pairs:
        host.swap_out(states, plans.swap_out.as_array())
    if plans.copy.pairs:
        states = copy_rows(states, plans.copy.as_array())
    if plans.swap_in.pairs:
        states = host.swap_in(states, plans.swap_in.as_array())
    return cache._replace(conv=states[0], recurrent=states[1])

"""Data-parallel attention: a step's KV writes and attention run per attention rank under
`jax.shard_map`, each rank on its own share of the page pool and its own requests.

Under data-parallel attention (`ParallelConfig.enable_dp_attention`) the devices of one
mesh axis are attention ranks. The step is laid out rank by rank: rank r's tokens are
`[r * T, (r + 1) * T)` of the token axis, its requests rows `[r * R, (r + 1) * R)` of the
block tables and KV lengths, its cumulative query lengths `cu_q_lens[r * (R + 1):(r + 1) *
(R + 1)]` counted from its own first token. The page pool is split on its page axis: rank
r holds global pages `[r * P, (r + 1) * P)`, and every page a request of rank r owns lies
there (`jaxserve.core.ranked_kv`). Block tables and slot mappings carry global ids; here
each rank subtracts its first page, so the kernels see a pool of P pages whose page 0 (the
rank's first, never handed out) is the null page that padding reads and writes.

Nothing crosses ranks here: no rank ever reads another's pages, and the pool is never
gathered. The tokens meet only at the experts (`models.moe_parallel.sharded_experts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.metadata import AttentionMetadata

PAGE_AXIS = 3  # the page axis of every pool (`kv_pages_shape`, `latent_pages_shape`)


@dataclasses.dataclass(frozen=True)
class AttentionRanks:
    """The mesh axis whose devices are attention ranks (hashable: part of the model's
    static `AttentionOps`).

    Attributes:
        mesh: The engine's mesh (every other axis of size 1: ranks are not split further).
        axis: The mesh axis of the ranks.
    """

    mesh: Mesh
    axis: str

    @property
    def num_ranks(self) -> int:
        """Devices along `axis`."""
        return self.mesh.shape[self.axis]

    def pool_spec(self, ndim: int = 6) -> P:
        """The PartitionSpec of a pool split on its page axis."""
        spec = [None] * ndim
        spec[PAGE_AXIS] = self.axis
        return P(*spec)


def _md_specs(md: AttentionMetadata, axis: str) -> AttentionMetadata:
    """PartitionSpecs of a rank-laid-out metadata: the token axis of the slot mapping
    (last) and the row axis of the tables (-2), the lengths' only axis."""
    tokens = P(*([None] * (md.slot_mapping.ndim - 1)), axis)
    tables = P(*([None] * (md.block_tables.ndim - 2)), axis, None)
    return dataclasses.replace(md, slot_mapping=tokens, block_tables=tables, kv_lens=P(axis),
                               cu_q_lens=P(axis), state_slots=None,
                               q_span_end=None if md.q_span_end is None else P(axis))


def local_metadata(md: AttentionMetadata, pages_per_rank: int, page_size: int,
                   rank) -> AttentionMetadata:
    """One rank's metadata from its slice of the global one: page ids and slots made
    local to its share of the pool (a padding entry, global 0, becomes its null page 0)."""
    return dataclasses.replace(
        md, slot_mapping=local_slots(md.slot_mapping, pages_per_rank, page_size, rank),
        block_tables=jnp.maximum(md.block_tables - rank * pages_per_rank, 0), num_ranks=1)


def local_slots(slot_mapping: jax.Array, pages_per_rank: int, page_size: int,
                rank) -> jax.Array:
    """One rank's slots (i32[..., T]) in its share of the pool: padding (global slot 0,
    outside the rank's pages) writes to its null page 0."""
    slots = slot_mapping - rank * pages_per_rank * page_size
    return jnp.where(slots >= 0, slots, 0)


def per_rank(ranks: AttentionRanks, fn: Callable, tokens: tuple, pool,
             md: AttentionMetadata | None = None, *, replicated: tuple = (),
             returns: str = "pool", slots_arg: int | None = None):
    """Runs `fn(*tokens, pool, md, *replicated)` on every rank's share.

    Args:
        ranks: The attention ranks.
        fn: The one-rank operation, on local arrays (`md` local, or None).
        tokens: Arrays whose leading axis is the step's tokens (rank-blocked).
        pool: The page pool [L, 2, Hkv, pages, page_size, D] (or a latent pool), split on
            its page axis.
        md: The rank-laid-out metadata (`md.num_ranks` ranks), or None.
        replicated: Arguments every rank takes whole (weights, the layer index).
        returns: "pool" (fn returns the pool), "tokens" (fn returns a token-major array).
        slots_arg: Index in `tokens` of a slot mapping to make local (`local_slots`).

    Returns:
        What `fn` returns, assembled: the pool split as it came, or the tokens rank-blocked.
    """
    axis = ranks.axis
    page_size = pool.shape[PAGE_AXIS + 1]
    pool_spec = ranks.pool_spec(pool.ndim)

    def local(toks, pool, md, rep):
        rank = jax.lax.axis_index(axis)
        pages = pool.shape[PAGE_AXIS]
        if md is not None:
            md = local_metadata(md, pages, page_size, rank)
        if slots_arg is not None:
            toks = list(toks)
            toks[slots_arg] = local_slots(toks[slots_arg], pages, page_size, rank)
        return fn(*toks, pool, md, *rep)

    if md is not None:
        md = dataclasses.replace(md, state_slots=None)
    run = jax.shard_map(local, mesh=ranks.mesh,
                        in_specs=(tuple(P(axis) for _ in tokens), pool_spec,
                                  None if md is None else _md_specs(md, axis),
                                  tuple(P() for _ in replicated)),
                        out_specs=pool_spec if returns == "pool" else P(axis),
                        check_vma=False)
    return run(tuple(tokens), pool, md, tuple(replicated))

"""The routed experts split over a device mesh: expert parallelism and the experts' width.

A mixture-of-experts layer on a mesh splits its expert stacks two ways at once
(`ExpertSharding`): the expert axis E over some mesh axes (expert parallelism: each device
holds E / n experts whole) and each expert's width I over others (tensor parallelism of
the experts, vLLM's default under `tensor_parallel_size`). `sharded_experts` runs the
grouped experts inside `jax.shard_map`: the tokens after attention are replicated, so every
device already holds every token and its routing; a device maps the (token, expert) pairs
routed to other devices' experts to a virtual expert past its own (sorted last, counted by
no group, weight 0), runs its local experts on its local pairs only, and one `psum` over
the splitting axes adds the devices' partial outputs (an all-reduce: the all-gather +
reduce-scatter family, which needs no token exchange because no device lacks a token).
Under data-parallel attention the tokens arrive split over the ranks
(`ExpertSharding.token_axes`): they are all-gathered first and the sum reduce-scattered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

# Leaves whose width I is their last axis ([E, H, I], gpt-oss's biases [E, I]); down's is
# its input axis (its bias [E, H] has no width axis: whole on every width shard).
_WIDTH_LAST = ("gate_proj", "up_proj", "gate_bias", "up_bias")


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
    """How a mesh splits the routed experts (hashable: a static module attribute).

    Attributes:
        mesh: The engine's device mesh.
        expert_axes: Mesh axes that split the expert axis E (empty: every device holds
            every expert).
        width_axes: Mesh axes that split each expert's width I (empty: experts whole).
        token_axes: Mesh axes the step's tokens arrive split over (data-parallel attention:
            each attention rank holds its own requests' tokens); empty: replicated.
    """

    mesh: Mesh
    expert_axes: tuple[str, ...] = ()
    width_axes: tuple[str, ...] = ()
    token_axes: tuple[str, ...] = ()

    def axis_size(self, axes: tuple[str, ...]) -> int:
        """Devices along `axes` together (1 for none)."""
        size = 1
        for a in axes:
            size *= self.mesh.shape[a]
        return size

    @property
    def num_expert_shards(self) -> int:
        """Devices the experts are spread over: each holds E / this many."""
        return self.axis_size(self.expert_axes)

    @property
    def num_width_shards(self) -> int:
        """Pieces each expert's width is cut into."""
        return self.axis_size(self.width_axes)

    def leaf_spec(self, name: str, shape: tuple[int, ...], stacked: bool) -> P:
        """The PartitionSpec of one expert leaf.

        Args:
            name: Its projection: "gate_proj", "up_proj" ([E, H, I]) or "down_proj"
                ([E, I, H]); quantized leaves under it keep the same leading axes and
                their width on the same side (the last axis of gate/up, axis -2 of down).
            shape: The leaf's shape.
            stacked: Whether it leads with the layer axis ([L, E, ...]).

        Raises:
            ValueError: A width split over devices that does not divide the leaf's width
                axis (quantized blocks that would straddle devices); a width of one (a
                per-column scale of down) stays whole.
        """
        spec: list = [None] * len(shape)
        e_axis = 1 if stacked else 0
        spec[e_axis] = self.expert_axes or None
        width = len(shape) - 1 if name in _WIDTH_LAST else len(shape) - 2
        # NOTE: a per-column scale of down (one row) stays whole: it scales each partial sum.
        if self.width_axes and width > e_axis and shape[width] > 1:
            if shape[width] % self.num_width_shards:
                raise ValueError(
                    f"expert leaf of {name} {shape}: its width axis ({shape[width]}: values, "
                    f"or quantized blocks of them) does not split over the "
                    f"{self.num_width_shards} tensor-parallel devices; use "
                    "enable_expert_parallel (whole experts per device) or a "
                    "tensor_parallel_size that divides it")
            spec[width] = self.width_axes
        return P(*spec)

    def tree_specs(self, experts: dict, stacked: bool) -> dict:
        """`leaf_spec` of every leaf of an experts dict ({projection: leaf or subtree})."""
        return {name: jax.tree_util.tree_map(
            lambda x, name=name: self.leaf_spec(name, x.shape, stacked), sub)
            for name, sub in experts.items()}


def local_routing(weights: jax.Array, ids: jax.Array, first: jax.Array, num_local: int):
    """One device's view of the routing: pairs of its experts [first, first + num_local)
    get local ids; the others get the virtual id `num_local` (sorted after every local
    expert, counted by no group) and weight 0.

    Args:
        weights: f32[T, k] routing weights.
        ids: i32[T, k] global expert ids.
        first: i32[] the device's first expert.
        num_local: Experts the device holds.

    Returns:
        (weights f32[T, k], ids i32[T, k]) in local numbering.
    """
    local = ids - first  # i32[T, k]
    mine = (local >= 0) & (local < num_local)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, local, num_local)


def sharded_experts(grouped: Callable, x: jax.Array, weights: jax.Array, ids: jax.Array,
                    experts: dict, act: str, sharding: ExpertSharding,
                    layer=None) -> jax.Array:
    """`grouped` (`models.moe.grouped_experts`) over the mesh of `sharding`: each device
    runs its experts (and its slice of their width) on the pairs routed to them, and the
    partial outputs are summed with one `psum`. With tokens split over
    `sharding.token_axes` (data-parallel attention) each device first gathers every rank's
    tokens (an all-gather of [T, H], never of any page) and the sum comes back split the
    same way (a reduce-scatter): the tokens travel to the experts and back.

    Args:
        grouped: The one-device grouped experts function, called as
            `grouped(x, weights, ids, experts, act, layer=layer)`.
        x: [T, H] tokens (replicated, or split over `sharding.token_axes`).
        weights: f32[T, k] routing weights (as x).
        ids: i32[T, k] global expert of each pair (as x).
        experts: The expert leaves, laid out by `sharding.leaf_spec` ([E, ...] per layer,
            or the whole [L, E, ...] stacks with `layer`).
        act: The gated MLP's activation.
        sharding: The mesh and the axes splitting E and I.
        layer: i32[] the layer to read from whole stacks, or None.

    Returns:
        [T, H] in x's dtype, laid out as x.
    """
    stacked = layer is not None
    e_axis = 1 if stacked else 0
    # NOTE: quantized leaves (a subtree per projection) keep the leading [L, E] axes.
    num_experts = jax.tree_util.tree_leaves(experts["gate_proj"])[0].shape[e_axis]
    num_local = num_experts // sharding.num_expert_shards
    reduce_over = tuple(a for a in (*sharding.expert_axes, *sharding.width_axes)
                        if sharding.mesh.shape[a] > 1)

    tokens = sharding.token_axes
    reduce_over = tuple(a for a in reduce_over if a not in tokens)

    def local(x, weights, ids, experts, layer):
        if tokens:  # every rank's tokens: [T, ...] from [T / ranks, ...]
            x, weights, ids = (jax.lax.all_gather(a, tokens, tiled=True)
                               for a in (x, weights, ids))
        first = (jax.lax.axis_index(sharding.expert_axes) * num_local
                 if sharding.expert_axes else jnp.int32(0))
        w, i = local_routing(weights, ids, first, num_local)
        y = grouped(x, w, i, experts, act, layer=layer)  # [T, H]: this device's part
        y = jax.lax.psum(y, reduce_over) if reduce_over else y
        return jax.lax.psum_scatter(y, tokens, tiled=True) if tokens else y

    layer_arg = jnp.int32(0) if layer is None else layer
    split = P(tokens) if tokens else P()
    run = jax.shard_map(
        lambda x, w, i, e, lay: local(x, w, i, e, lay if stacked else None),
        mesh=sharding.mesh,
        in_specs=(split, split, split, sharding.tree_specs(experts, stacked), P()),
        out_specs=split,
        # NOTE: the expert loop's carry starts replicated and becomes device-varying.
        check_vma=False)
    return run(x, weights, ids, experts, layer_arg)

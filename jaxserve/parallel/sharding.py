"""Tensor parallelism through GSPMD: a 1-D device mesh and explicit shardings for params,
the KV page pool and step inputs.

Megatron-style: q/k/v and gate/up projections are split by output columns (heads, MLP
units), o and down projections by input rows, so each layer needs one all-reduce after
attention and one after the MLP, which XLA inserts. The LM head is split by vocabulary.

The mesh is 2-D, ("kv", "rep"): KV heads (K/V projections and the page pool's KV-head
axis) split over "kv", everything head- or unit-parallel over both. With at least as many
KV heads as devices "rep" has size 1; with fewer (say 2 KV heads on 4 devices) each KV
head is replicated on the `rep` devices holding its query heads, so no device ever needs
another's pages. Page ids, block tables and the scheduler are unchanged: one host-side
scheduler drives every shard.

A mixture of experts adds a third axis in front, "expert" (`expert_parallel_size`, 1 by
default): the mesh is ("expert", "kv", "rep") of expert_parallel_size x
tensor_parallel_size devices. Attention and every dense weight are split over ("kv",
"rep") as above and replicated over "expert" (each expert group computes the same tokens'
attention: one engine has no data-parallel attention). The routed experts' stacks are
split on their expert axis E and each expert's width I (`models.moe_parallel`): plain
tensor parallelism splits I over ("kv", "rep") (vLLM's default); `enable_expert_parallel`
splits E over ("kv", "rep") instead, whole experts per device (vLLM's: EP size = TP size);
an `expert_parallel_size` splits E over "expert" as well.

Data-parallel attention (`ParallelConfig.enable_dp_attention`, tensor parallelism 1) makes
the "expert" devices attention ranks instead (`attention_ranks`): the page pool is split on
its page axis over "expert", each rank attends only its own requests
(`pallas_kernels.rank_split`), the step's tokens are split over "expert" rank by rank, and
the experts gather them and hand them back (`ExpertSharding.token_axes`). The latent pool
of multi-head latent attention, one "head" that tensor parallelism would copy onto every
device, is never replicated.

A linear-attention hybrid's Gated DeltaNet layers split over ("kv", "rep") by key heads and
the value heads each serves, their state pools likewise (`TensorParallel.state_shardings`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.linear import STACKS
from models.linear.registry import stored_method
from models.moe_parallel import ExpertSharding
from pallas_kernels.rank_split import AttentionRanks

logger = logging.getLogger("jaxserve")
EXPERT, KV, REP = "expert", "kv", "rep"
ALL = (KV, REP)  # head- and unit-parallel dimensions split over the tensor-parallel devices

# Module -> how Megatron's layout splits it: "out" (column parallel: the output axis) or
# "in" (row parallel: the input axis), over which mesh axes. Which axis of each leaf that
# is, is its linear method's business (`LinearMethod.partition_spec`); unlisted modules
# are replicated (the LM head splits its vocabulary where the devices divide it).
_ROLES = {"q_proj": ("out", ALL), "gate_proj": ("out", ALL), "up_proj": ("out", ALL),
          "k_proj": ("out", KV), "v_proj": ("out", KV), "o_proj": ("in", ALL),
          "down_proj": ("in", ALL), "lm_head": ("out", ALL),
          # Gated DeltaNet (`models.gated_deltanet`): split by key heads and the value heads
          # each serves (`in_proj_qkv`'s channels are grouped by key head at load).
          "in_proj_qkv": ("out", ALL), "in_proj_z": ("out", ALL), "in_proj_b": ("out", ALL),
          "in_proj_a": ("out", ALL), "out_proj": ("in", ALL),
          # Multi-head latent attention (`models.mla`): the query's and kv_b's heads split,
          # q_a and kv_a (one latent per token, the same on every device) replicated.
          "q_b_proj": ("out", ALL), "kv_b_proj": ("out", ALL)}
# A Gated DeltaNet layer's own leaves [L_lin, ...], split on their channel or head axis.
_LINEAR_LEAVES = {"conv1d": P(None, None, ALL), "A_log": P(None, ALL), "dt_bias": P(None, ALL)}


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel layout for one model over `mesh` (with expert parallelism for a
    mixture of experts).

    Attributes:
        mesh: Mesh with axes ("expert", "kv", "rep").
        experts: How the mesh splits the routed experts (a mixture of experts' layout);
            None for a dense model.
        split_linear: Whether the linear-attention layers (and their state pools) split by
            heads; False for Mamba-2 layers, which every device runs whole (replicated).
        attention_ranks: Data-parallel attention over "expert" (the pool split by pages,
            the tokens by ranks); None: every device attends every request.
        whole_pool: The pool is replicated, not split by KV heads (a latent pool's one
            "head" under plain tensor parallelism).
    """

    mesh: Mesh
    experts: ExpertSharding | None = None
    split_linear: bool = True
    attention_ranks: AttentionRanks | None = None
    whole_pool: bool = False

    @property
    def num_attention_ranks(self) -> int:
        """Ranks the requests' attention is spread over (1: none)."""
        return 1 if self.attention_ranks is None else self.attention_ranks.num_ranks

    @property
    def shard_kv_heads(self) -> bool:
        """Whether every device holds distinct KV heads (no replication)."""
        return self.mesh.shape[REP] == 1

    @property
    def size(self) -> int:
        """The tensor-parallel size: devices that split heads and MLP units ("kv" x
        "rep"); `num_devices` counts the expert axis too."""
        return self.mesh.shape[KV] * self.mesh.shape[REP]

    @property
    def num_devices(self) -> int:
        """Devices of the mesh: expert_parallel_size x tensor_parallel_size."""
        return self.mesh.devices.size

    def param_specs(self, params) -> dict:
        """PartitionSpec tree matching `params` (stacked layers lead with the layer axis):
        the "params" tree, or a serving form's variables dict ({"params": ...,
        `models.linear.STACKS`: ...}: panels, whole experts)."""
        collections = "params" in params  # a variables dict: paths lead with the collection

        def spec(keys, leaf, siblings):
            if collections and keys[0] in ("params", STACKS):
                keys = keys[1:]
            if "experts" in keys[:-1] and self.experts is not None:  # [L, E, ...] stacks
                name = keys[keys.index("experts") + 1]
                if keys[-1] == "qweight":
                    # FP8 blocks and q4/q8 groups: the codes' width split must fall on
                    # block boundaries (the scales split by blocks beside them); the
                    # method refuses others.
                    _checked(keys, lambda: stored_method(siblings).partition_spec(
                        "qweight", np.shape(leaf), "in" if name == "down_proj" else "out",
                        None, self.experts.num_width_shards))
                return self.experts.leaf_spec(name, np.shape(leaf), keys[0] == "layers")
            if not self.split_linear and "linear_attn" in keys:
                return P()
            if len(keys) >= 2 and keys[-2] == "linear_attn" and keys[-1] in _LINEAR_LEAVES:
                return _LINEAR_LEAVES[keys[-1]]
            if "experts" in keys or len(keys) < 2 or keys[-2] not in _ROLES:
                return P()  # replicated (experts without an expert layout included)
            split, axes = _ROLES[keys[-2]]
            shards = self.mesh.shape[KV] if axes == KV else self.size
            # NOTE: a vocabulary the devices do not divide keeps the head whole; the row
            # parallel leaves whose blocks they do not divide (one scale per column) too.
            return _checked(keys, lambda: stored_method(siblings).partition_spec(
                keys[-1], np.shape(leaf), split, axes, shards))

        def walk(tree, keys):
            return {k: walk(v, (*keys, k)) if isinstance(v, dict) else spec((*keys, k), v, tree)
                    for k, v in tree.items()}

        return walk(params, ())

    def param_shardings(self, params) -> dict:
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s),
                                      self.param_specs(params))

    def lora_shardings(self, stacks: dict) -> dict:
        """Shardings of LoRA slot stacks (`models.lora.COLLECTION`'s tree: {"layers":
        {block: {module: {"a": [L, S, in, R], "b": [L, S, R, out]}}}}) that match the base
        weights: a column-parallel module's B split on its output axis (its A whole), a
        row-parallel module's A split on its input axis (its B whole)."""

        def spec(path, leaf):
            module, which = path[-2].key, path[-1].key
            split, axes = _ROLES.get(module, (None, None))
            if which == "b" and split == "out":
                return NamedSharding(self.mesh, P(None, None, None, axes))
            if which == "a" and split == "in" and np.shape(leaf)[1] % self.size == 0:
                return NamedSharding(self.mesh, P(None, ALL, None, None))
            return self.replicated()

        return jax.tree_util.tree_map_with_path(spec, stacks)

    def kv_pages_sharding(self) -> NamedSharding:
        """The pool [L, 2, Hkv, pages, page_size, D] split on its KV-head axis (replicated
        over "expert"), or under data-parallel attention on its page axis over "expert"."""
        if self.attention_ranks is not None:
            return NamedSharding(self.mesh, self.attention_ranks.pool_spec())
        if self.whole_pool:
            return self.replicated()
        return NamedSharding(self.mesh, P(None, None, KV))

    def state_shardings(self) -> dict[str, NamedSharding]:
        """The state pools of a model with linear-attention layers
        (`models.gated_deltanet.HybridCache`): "conv" [L_lin, S, W - 1, C] split on its
        channels, "recurrent" [L_lin, S, Hv, dk, dv] on its value heads, as the layers'
        weights are (replicated with `split_linear` off)."""
        if not self.split_linear:
            return {"conv": self.replicated(), "recurrent": self.replicated()}
        return {"conv": NamedSharding(self.mesh, P(None, None, None, ALL)),
                "recurrent": NamedSharding(self.mesh, P(None, None, ALL))}

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def shard_params(self, params) -> dict:
        """Places `params` on the mesh (each device receives only its shard)."""
        return jax.device_put(params, self.param_shardings(params))


def _checked(keys: tuple, spec):
    """`spec()`, its ValueError (a split a method refuses) prefixed with the layer's path."""
    try:
        return spec()
    except ValueError as e:
        raise ValueError(f"{'/'.join(map(str, keys[:-1]))}: {e}") from None

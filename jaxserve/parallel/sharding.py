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

from models.config import ArchConfig
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

    def tokens_sharding(self) -> NamedSharding:
        """How a step's token axis lies: split rank by rank under data-parallel attention,
        else replicated."""
        if self.attention_ranks is None:
            return self.replicated()
        return NamedSharding(self.mesh, P(EXPERT))

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


def splits_linear_layers(cfg: ArchConfig) -> bool:
    """Whether tensor parallelism splits `cfg`'s linear-attention layers by heads (Gated
    DeltaNet; a model without them too) or runs them whole on every device (Mamba-2)."""
    # NOTE: a Mamba-2 layer's in_proj mixes z, x, B, C and dt rows and Granite's G = 1
    # group spans every head (B, C and the gated norm): a split by heads needs in_proj
    # regrouped per shard with B and C copied.
    return not (cfg.has_linear_attention and cfg.linear_kind == "mamba2")


def make_tensor_parallel(cfg: ArchConfig, size: int, devices: list | None = None,
                         expert_parallel_size: int = 1,
                         enable_expert_parallel: bool = False,
                         dp_attention: bool = False) -> TensorParallel:
    """Builds the layout for `expert_parallel_size` x `size` devices (default: the first
    local devices; expert groups of `size` consecutive devices).

    Args:
        cfg: The model's architecture.
        size: tensor_parallel_size: devices that split heads and MLP units.
        devices: The devices to use (the first expert_parallel_size x size of them).
        expert_parallel_size: Devices of the "expert" axis (a mixture of experts only).
        enable_expert_parallel: Split the experts over the tensor-parallel devices (whole
            experts per device) instead of each expert's width (a mixture of experts only).
        dp_attention: Data-parallel attention over the "expert" axis (`attention_ranks`).

    Raises:
        ValueError: `size` does not divide the query heads or the MLP width, KV heads and
            `size` do not divide one another, too few devices exist, an expert layout
            the model does not allow (`expert_layout`), `size` does not divide a
            Gated DeltaNet model's `linear_num_key_heads`, data-parallel attention for
            a dense model, a linear-attention hybrid or `size` over 1.
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if cfg.is_mla and size > 1:
        # NOTE: the one latent "head" is copied onto every device (each attends its query
        # heads over all of it); data-parallel attention splits the pool instead.
        logger.warning("jaxserve: %s keeps one latent per token: under tensor_parallel_size "
                       "%d every device holds the whole latent pool (enable_dp_attention "
                       "with expert_parallel_size splits it)", cfg.architecture, size)
    split_linear = splits_linear_layers(cfg)
    if split_linear and cfg.has_linear_attention and cfg.linear_num_key_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide linear_num_key_heads="
                         f"{cfg.linear_num_key_heads} of {cfg.architecture} (its Gated "
                         "DeltaNet layers split by key heads)")
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide num_heads="
                         f"{cfg.num_heads} of {cfg.architecture}")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size="
                         f"{cfg.intermediate_size}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_kv_heads={cfg.num_kv_heads} "
                         "must divide one another")
    expert_axes, width_axes = expert_layout(cfg, size, expert_parallel_size,
                                            enable_expert_parallel)
    devices = list(devices if devices is not None else jax.devices())
    need = expert_parallel_size * size
    if len(devices) < need:
        what = (f"tensor_parallel_size={size}" if expert_parallel_size == 1 else
                f"expert_parallel_size={expert_parallel_size} x tensor_parallel_size={size}")
        raise ValueError(f"{what} needs {need} devices; {len(devices)} available")
    num_kv = min(size, cfg.num_kv_heads)
    grid = np.asarray(devices[:need]).reshape(expert_parallel_size, num_kv, size // num_kv)
    mesh = Mesh(grid, (EXPERT, KV, REP))
    if num_kv < size:
        logger.warning("jaxserve: %d KV heads < tensor_parallel_size %d: each KV head (and its "
                       "pages) is replicated on %d devices", cfg.num_kv_heads, size,
                       size // num_kv)
    ranks = None
    if dp_attention:
        check_dp_attention(cfg, size, expert_parallel_size)
        ranks = AttentionRanks(mesh, EXPERT)
    experts = ExpertSharding(mesh, expert_axes, width_axes,
                             (EXPERT,) if ranks is not None else ()) if cfg.is_moe else None
    if not split_linear and size > 1:
        logger.warning("jaxserve: %s's Mamba-2 layers and their state are replicated on the "
                       "%d tensor-parallel devices (attention and MLPs split)",
                       cfg.architecture, size)
    return TensorParallel(mesh, experts, split_linear, ranks, whole_pool=cfg.is_mla)


def check_dp_attention(cfg: ArchConfig, size: int, expert_parallel_size: int) -> None:
    """Refuses data-parallel attention where it is not built.

    Raises:
        ValueError: A dense model (no experts for the tokens to meet at), a model with
            linear-attention layers (their state pools are not split by ranks), a
            tensor_parallel_size over 1, or an expert_parallel_size of 1.
    """
    if not cfg.is_moe:
        raise ValueError(f"enable_dp_attention needs a mixture-of-experts model; "
                         f"{cfg.architecture} is dense (use data_parallel_size for replicas)")
    if cfg.has_linear_attention:
        raise ValueError(f"enable_dp_attention is not built for {cfg.architecture}'s "
                         "linear-attention layers (their state pools are not split by ranks)")
    if size != 1 or expert_parallel_size < 2:
        raise ValueError(f"enable_dp_attention needs tensor_parallel_size=1 and an "
                         f"expert_parallel_size over 1; got {size} and {expert_parallel_size}")


def expert_layout(cfg: ArchConfig, size: int, expert_parallel_size: int = 1,
                  enable_expert_parallel: bool = False
                  ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes that split a mixture of experts' expert axis E and each expert's width
    I: ("expert",) with an expert_parallel_size over 1, plus ("kv", "rep") for E with
    `enable_expert_parallel`, else for I.

    Raises:
        ValueError: expert_parallel_size < 1, expert parallelism asked of a dense model, E
            not divisible by the devices splitting it, or I (or the shared expert's
            width) not divisible by the tensor-parallel size that splits it.
    """
    if isinstance(expert_parallel_size, bool) or not isinstance(expert_parallel_size, int) \
            or expert_parallel_size < 1:
        raise ValueError(f"expert_parallel_size must be at least 1, got {expert_parallel_size!r}")
    if not cfg.is_moe:
        if enable_expert_parallel or expert_parallel_size > 1:
            arg = ("enable_expert_parallel" if enable_expert_parallel
                   else f"expert_parallel_size={expert_parallel_size}")
            raise ValueError(f"{arg} needs a mixture-of-experts model; {cfg.architecture} "
                             "is dense (num_experts=0)")
        return (), ()
    expert_axes = ((EXPERT,) if expert_parallel_size > 1 else ()) + (
        ALL if enable_expert_parallel else ())
    width_axes = () if enable_expert_parallel else ALL
    split = expert_parallel_size * (size if enable_expert_parallel else 1)
    if cfg.num_experts % split:
        arg = " x ".join([*([f"expert_parallel_size={expert_parallel_size}"]
                            if expert_parallel_size > 1 else []),
                          *([f"tensor_parallel_size={size} (enable_expert_parallel)"]
                            if enable_expert_parallel else [])])
        raise ValueError(f"{arg} does not divide num_experts={cfg.num_experts}: each device "
                         "holds an equal share of whole experts")
    if not enable_expert_parallel and cfg.moe_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide moe_intermediate_size="
                         f"{cfg.moe_intermediate_size} (each expert's width is split; "
                         "enable_expert_parallel keeps experts whole)")
    if cfg.shared_expert_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide "
                         f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}")
    return expert_axes, width_axes


def process_spanning_devices(size: int) -> list:
    """A tensor-parallel mesh's devices over several processes (hosts): an equal share,
    `size / process_count`, of each process's devices, so every process holds shards.

    Raises:
        ValueError: `size` is not a multiple of the process count, or a process has fewer
            devices than its share.
    """
    n = jax.process_count()
    if size % n:
        raise ValueError(f"tensor_parallel_size={size} must be a multiple of the {n} "
                         "processes (hosts): each holds an equal share of the mesh")
    per = size // n
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    for p, devices in sorted(by_process.items()):
        if len(devices) < per:
            raise ValueError(f"tensor_parallel_size={size} over {n} processes needs {per} "
                             f"devices in each; process {p} has {len(devices)}")
    return [d for p in sorted(by_process) for d in by_process[p][:per]]


def tensor_parallel_layout(config, cfg: ArchConfig) -> TensorParallel | None:
    """The mesh layout of an engine's devices (`config.parallel` of an `EngineConfig`),
    or None for the default device.

    Raises:
        ValueError: data_parallel_size > 1 (use `LLM` or `DataParallelEngine`), unknown
            device ids, or a tensor- or expert-parallel size the model does not allow.
    """
    par = config.parallel
    if par.data_parallel_size > 1:
        raise ValueError("LLMEngine serves one replica; data_parallel_size > 1 needs "
                         "jaxserve.engine.data_parallel.DataParallelEngine (LLM picks it)")
    ep = par.expert_parallel_size or 1
    if par.enable_dp_attention:
        check_dp_attention(cfg, par.tensor_parallel_size, ep)
    # NOTE: checked even where no mesh is built (expert parallelism of a dense model).
    expert_layout(cfg, par.tensor_parallel_size, ep, par.enable_expert_parallel)
    if jax.process_count() > 1 and par.device_ids is None:
        devices = process_spanning_devices(par.devices_per_replica)
    elif par.devices_per_replica == 1 and par.device_ids is None:
        return None
    else:
        devices = jax.devices()
    if par.device_ids is not None:
        by_id = {d.id: d for d in devices}
        missing = [i for i in par.device_ids if i not in by_id]
        if missing:
            raise ValueError(f"device_ids {missing} do not exist; devices: {sorted(by_id)}")
        devices = [by_id[i] for i in par.device_ids]
    layout = make_tensor_parallel(cfg, par.tensor_parallel_size, devices, ep,
                                  par.enable_expert_parallel, par.enable_dp_attention)
    logger.info("jaxserve: tensor parallel over %s (mesh %s)",
                [d.id for d in layout.mesh.devices.flat], dict(layout.mesh.shape))
    if layout.experts is not None:
        ex = layout.experts
        logger.info("jaxserve: %d experts: %d per device (expert axis over %s), each "
                    "expert's width in %d pieces (over %s)", cfg.num_experts,
                    cfg.num_experts // ex.num_expert_shards, list(ex.expert_axes) or "none",
                    ex.num_width_shards, list(ex.width_axes) or "none")
    return layout

"""An engine's device-mesh layout from its config: the mesh of `expert_parallel_size` x
`tensor_parallel_size` devices, how a mixture of experts splits its experts over it, data-
parallel attention's ranks, and the checks of each (the layout itself: `sharding.py`)."""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.parallel.sharding import ALL, EXPERT, KV, REP, TensorParallel
from models.config import ArchConfig
from models.moe_parallel import ExpertSharding
from pallas_kernels.rank_split import AttentionRanks

logger = logging.getLogger("jaxserve")


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
    for field_name, heads in (("num_kv_heads", cfg.num_kv_heads),
                              ("global_kv_heads", cfg.global_kv_heads)):
        if heads and heads % size and size % heads:
            raise ValueError(f"tensor_parallel_size={size} and {field_name}={heads} "
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

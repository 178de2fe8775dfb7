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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ArchConfig

logger = logging.getLogger("jaxserve")
KV, REP = "kv", "rep"
ALL = (KV, REP)  # head- and unit-parallel dimensions split over every device

# Leaf path suffix -> which axis of the (stacked) parameter is split: "out" = last axis
# (column parallel), "in" = the input axis (row parallel). Unlisted leaves are replicated.
# Quantized weights (`models.quant`: codes, scales, zeros, all laid out [K..., N]) split
# like the float kernel they replace.
_WEIGHTS = ("kernel", "qweight", "scales", "zeros")
_COLUMN = {(m, leaf) for m in ("q_proj", "gate_proj", "up_proj") for leaf in (*_WEIGHTS, "bias")}
_KV_COLUMN = {(m, leaf) for m in ("k_proj", "v_proj") for leaf in (*_WEIGHTS, "bias")}
_ROW = {(m, leaf) for m in ("o_proj", "down_proj") for leaf in _WEIGHTS}


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel layout for one model over `mesh`.

    Attributes:
        mesh: Mesh with axes ("kv", "rep").
    """

    mesh: Mesh

    @property
    def shard_kv_heads(self) -> bool:
        """Whether every device holds distinct KV heads (no replication)."""
        return self.mesh.shape[REP] == 1

    @property
    def size(self) -> int:
        return self.mesh.devices.size

    def param_specs(self, params) -> dict:
        """PartitionSpec tree matching `params` (stacked layers lead with the layer axis)."""

        def spec(path, leaf):
            keys = tuple(p.key for p in path)
            if "experts" in keys:  # routed experts replicated, quantized leaves included
                return P()
            tail = keys[-2:]
            ndim = np.ndim(leaf)
            if tail in _COLUMN:
                return P(*([None] * (ndim - 1)), ALL)
            if tail in _KV_COLUMN:
                return P(*([None] * (ndim - 1)), KV)
            if tail in _ROW:
                if np.shape(leaf)[-2] % self.size:  # one scale per column: replicated
                    return P()
                return P(*([None] * (ndim - 2)), ALL, None)
            if keys[0] == "lm_head" and np.shape(leaf)[-1] % self.size == 0:
                return P(None, ALL)  # vocabulary split; logits are gathered
            return P()

        return jax.tree_util.tree_map_with_path(spec, params)

    def param_shardings(self, params) -> dict:
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s),
                                      self.param_specs(params))

    def kv_pages_sharding(self) -> NamedSharding:
        """The pool [L, 2, Hkv, pages, page_size, D] split on its KV-head axis."""
        return NamedSharding(self.mesh, P(None, None, KV))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def shard_params(self, params) -> dict:
        """Places `params` on the mesh (each device receives only its shard)."""
        return jax.device_put(params, self.param_shardings(params))


def make_tensor_parallel(cfg: ArchConfig, size: int,
                         devices: list | None = None) -> TensorParallel:
    """Builds the layout for `size` devices (default: the first `size` local devices).

    Raises:
        ValueError: `size` does not divide the query heads or the MLP width, KV heads and
            `size` do not divide one another, or too few devices exist.
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide num_heads="
                         f"{cfg.num_heads} of {cfg.architecture}")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size="
                         f"{cfg.intermediate_size}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_kv_heads={cfg.num_kv_heads} "
                         "must divide one another")
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} devices; "
                         f"{len(devices)} available")
    num_kv = min(size, cfg.num_kv_heads)
    mesh = Mesh(np.asarray(devices[:size]).reshape(num_kv, size // num_kv), (KV, REP))
    if num_kv < size:
        logger.warning("jaxserve: %d KV heads < tensor_parallel_size %d: each KV head (and its "
                       "pages) is replicated on %d devices", cfg.num_kv_heads, size,
                       size // num_kv)
    return TensorParallel(mesh)


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
            device ids, or a tensor-parallel size the model's heads do not allow.
    """
    par = config.parallel
    if par.data_parallel_size > 1:
        raise ValueError("LLMEngine serves one replica; data_parallel_size > 1 needs "
                         "jaxserve.engine.data_parallel.DataParallelEngine (LLM picks it)")
    if jax.process_count() > 1 and par.device_ids is None:
        devices = process_spanning_devices(par.tensor_parallel_size)
    elif par.tensor_parallel_size == 1 and par.device_ids is None:
        return None
    else:
        devices = jax.devices()
    if par.device_ids is not None:
        by_id = {d.id: d for d in devices}
        missing = [i for i in par.device_ids if i not in by_id]
        if missing:
            raise ValueError(f"device_ids {missing} do not exist; devices: {sorted(by_id)}")
        devices = [by_id[i] for i in par.device_ids]
    layout = make_tensor_parallel(cfg, par.tensor_parallel_size, devices)
    logger.info("jaxserve: tensor parallel over %s (mesh %s)",
                [d.id for d in layout.mesh.devices.flat], dict(layout.mesh.shape))
    return layout

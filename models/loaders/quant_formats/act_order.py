"""Act-order checkpoints (GPTQ's `desc_act`, compressed-tensors' `actorder`), read as they are:
input k of a Linear is in group g_idx[k], in any order. At load the K axis is sorted by group
(stable), so every group is a contiguous run of K as `q4`/`q8` store them, and the sorting
permutation is kept as the weight's `perm` leaf (`models.quant.QuantFormat.act_order`): the
linear methods gather the activations with it (x[:, perm] @ w[perm] = x @ w). Nothing is
re-quantized. A module gets the leaf only where some layer's (or expert's) g_idx is not
already sorted (`act_order_modules`): a trivial g_idx costs nothing.
"""

from __future__ import annotations

import numpy as np

from models.config import ArchConfig
from models.loaders.quant_formats.fp8 import LAYER_MODULES
from models.loaders.quant_formats.int_groups import to_rows
from models.loaders.safetensors_dir import SafetensorsDir
from models.quant import EXPERT_MODULES, PERM, QuantFormat


def module_names(cfg: ArchConfig) -> dict[str, list[str]]:
    """{plan module: its checkpoint names in every layer (and expert)}, and the modules that
    stay float whatever a config says (`lm_head`, the MoE `router`)."""
    layers = range(cfg.num_layers)
    names = {}
    for module in LAYER_MODULES:
        prefix = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        if prefix == "mlp" and cfg.is_moe:
            prefix = "mlp.shared_expert" if cfg.shared_expert_intermediate_size else ""
        if prefix:
            names[module] = [f"model.layers.{i}.{prefix}.{module}" for i in layers]
    if cfg.is_moe:
        for module in EXPERT_MODULES:
            proj = module.split(".")[1]
            names[module] = [f"model.layers.{i}.mlp.experts.{e}.{proj}" for i in layers
                             for e in range(cfg.num_experts)]
        names["router"] = [f"model.layers.{i}.mlp.gate" for i in layers]
    names["lm_head"] = ["lm_head"]
    return names


def act_order_modules(path: str, cfg: ArchConfig, modules, field: str) -> set[str]:
    """The plan modules among `modules` whose `<name>.<field>` (g_idx) is out of order in
    some layer or expert of the safetensors directory `path` (a missing one is in order).
    Only these keep a permutation; their g_idx are checked when each weight is read."""
    files = SafetensorsDir(path)
    present = set(files.names())
    names = module_names(cfg)
    return {module for module in modules
            if any(f"{name}.{field}" in present
                   and np.any(np.diff(files.get(f"{name}.{field}").reshape(-1)) < 0)
                   for name in names.get(module, ()))}


def check_g_idx(g_idx: np.ndarray, k: int, groups: int, tensor: str, field: str) -> np.ndarray:
    """`g_idx` as i64[K] after checking it: K integers in [0, groups), each group
    k / groups of them (as GPTQ and llm-compressor assign them).

    Raises:
        ValueError: A wrong shape or dtype, a value out of range, or groups of unequal size;
            the message names the tensor and the field.
    """
    where = f"quantized tensor {tensor!r}: {field}"
    if g_idx.shape != (k,) or not np.issubdtype(g_idx.dtype, np.integer):
        raise ValueError(f"{where} must be an integer array of shape ({k},) (one group per "
                         f"input feature), got {g_idx.dtype}{list(g_idx.shape)}")
    g_idx = g_idx.astype(np.int64)
    if k and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise ValueError(f"{where} holds groups {g_idx.min()}..{g_idx.max()}, outside "
                         f"[0, {groups}) (the scales' groups)")
    sizes = np.bincount(g_idx, minlength=groups)
    if np.any(sizes != k // groups):
        raise ValueError(f"{where} puts {sizes.min()} to {sizes.max()} inputs in a group; "
                         f"every group must hold {k // groups}")
    return g_idx


def group_rows(fmt: QuantFormat, codes: np.ndarray, scales: np.ndarray,
               zero_points: np.ndarray, g_idx: np.ndarray | None, tensor: str,
               field: str) -> dict[str, np.ndarray]:
    """Row-form leaves of codes u8[N, K] whose input k is in group g_idx[k] (None: k // the
    group size), with group scales and zero points [N, G]: sorted by group with `perm`
    i32[1, K] beside them when `fmt.act_order`, else as they are.

    Raises:
        ValueError: A bad g_idx (`check_g_idx`), or one out of order for a module the plan
            keeps without a permutation.
    """
    k, groups = codes.shape[1], scales.shape[1]
    if g_idx is not None:
        g_idx = check_g_idx(np.asarray(g_idx), k, groups, tensor, field)
    if not fmt.act_order:
        if g_idx is not None and np.any(np.diff(g_idx) < 0):
            raise ValueError(f"quantized tensor {tensor!r}: {field} orders groups by "
                             "activation, but the config says the groups are in order "
                             "(desc_act/actorder not set)")
        return to_rows(fmt, codes, scales, zero_points)
    perm = np.arange(k) if g_idx is None else np.argsort(g_idx, kind="stable")  # i64[K]
    rows = to_rows(fmt, codes[:, perm], scales, zero_points)
    return {**rows, PERM: perm.astype(np.int32)[None]}

"""Granite 4.0's checkpoint names for the decoder's tensors: the Mamba-2 layers' `mamba`
module (the decoder's `linear_attn` stack), the shared MLP (`shared_mlp.input_linear`: the
gate's rows, then the up projection's; `shared_mlp.output_linear`: the down projection) and
the routed experts (`block_sparse_moe`: `router.layer`, and every expert of a layer in one
stacked tensor, `input_linear` [E, 2 I, H] gate then up rows, `output_linear` [E, H, I])."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from models.config import ArchConfig

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
# The decoder's module -> (Granite's module, which rows of it: None whole, else gate/up
# half). With routed experts the shared MLP is the `MoEMLP`'s `shared_expert`; without,
# the decoder's dense `mlp`.
_MODULES = {".linear_attn.": (".mamba.", None),
            ".mlp.shared_expert.gate_proj.": (".shared_mlp.input_linear.", 0),
            ".mlp.shared_expert.up_proj.": (".shared_mlp.input_linear.", 1),
            ".mlp.shared_expert.down_proj.": (".shared_mlp.output_linear.", None),
            ".mlp.gate_proj.": (".shared_mlp.input_linear.", 0),
            ".mlp.up_proj.": (".shared_mlp.input_linear.", 1),
            ".mlp.down_proj.": (".shared_mlp.output_linear.", None),
            ".mlp.gate.": (".block_sparse_moe.router.layer.", None)}
# One routed expert's tensor as `models.loaders.hf_names.family_hf_name` names it.
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_STACKS = {"gate_proj": ("input_linear", 0), "up_proj": ("input_linear", 1),
                  "down_proj": ("output_linear", None)}


class GraniteTensor(NamedTuple):
    """Where one of the decoder's tensors is in a Granite checkpoint.

    Attributes:
        name: Granite's tensor name.
        half: 0 or 1 for the gate or up rows of a fused `input_linear`; None: whole.
        expert: The routed expert's index in a stacked `block_sparse_moe` tensor; None:
            not a routed expert's.
    """

    name: str
    half: int | None = None
    expert: int | None = None


def is_granite(cfg: ArchConfig) -> bool:
    """Whether `cfg`'s checkpoints name their tensors Granite's way."""
    return cfg.architecture == ARCHITECTURE


def granite_name(name: str) -> GraniteTensor:
    """Where the decoder's HF-style tensor `name` is in a Granite checkpoint."""
    expert = _EXPERT.search(name)
    if expert is not None:
        stack, half = _EXPERT_STACKS[expert.group(2)]
        theirs = f"{name[:expert.start()]}.block_sparse_moe.{stack}.weight"
        return GraniteTensor(theirs, half, int(expert.group(1)))
    for ours, (theirs, half) in _MODULES.items():
        if ours in name:
            return GraniteTensor(name.replace(ours, theirs, 1), half)
    return GraniteTensor(name)


def get_granite(source, cfg: ArchConfig, name: str) -> np.ndarray:
    """The tensor the decoder calls `name`, read from a Granite checkpoint `source`: a
    routed expert's slice of its layer's stack, a half of a fused `input_linear`'s rows.

    Raises:
        KeyError: The Granite tensor is absent.
        ValueError: A stack with fewer experts than `num_local_experts`, or a fused
            `input_linear` whose rows are not twice its MLP's width (`intermediate_size` for
            the experts, `shared_intermediate_size` for the shared MLP).
    """
    theirs, half, expert = granite_name(name)
    arr = source.get(theirs)
    if expert is not None:
        if arr.ndim != 3 or arr.shape[0] != cfg.num_experts:
            raise ValueError(f"tensor {theirs!r} has shape {arr.shape}, expected "
                             f"num_local_experts = {cfg.num_experts} stacked experts for "
                             f"{cfg.architecture}")
        arr = arr[expert]
    if half is None:
        return arr
    width, field = ((cfg.moe_intermediate_size, "intermediate_size") if expert is not None
                    else (cfg.shared_expert_intermediate_size or cfg.intermediate_size,
                          "shared_intermediate_size"))
    if arr.shape[0] != 2 * width:
        raise ValueError(f"tensor {theirs!r} has {arr.shape[0]} rows, expected 2 x "
                         f"{field} = {2 * width} for {cfg.architecture}")
    return arr[half * width:(half + 1) * width]

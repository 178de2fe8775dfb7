"""Granite 4.0's checkpoint names for the decoder's tensors: the Mamba-2 layers' `mamba`
module (the decoder's `linear_attn` stack) and the shared MLP (`shared_mlp.input_linear`: the
gate's rows, then the up projection's; `shared_mlp.output_linear`: the down projection)."""

from __future__ import annotations

import numpy as np

from models.config import ArchConfig

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
# The decoder's module -> (Granite's module, which rows of it: None whole, else gate/up half).
_MODULES = {".linear_attn.": (".mamba.", None),
            ".mlp.gate_proj.": (".shared_mlp.input_linear.", 0),
            ".mlp.up_proj.": (".shared_mlp.input_linear.", 1),
            ".mlp.down_proj.": (".shared_mlp.output_linear.", None)}


def is_granite(cfg: ArchConfig) -> bool:
    """Whether `cfg`'s checkpoints name their tensors Granite's way."""
    return cfg.architecture == ARCHITECTURE


def granite_name(name: str) -> tuple[str, int | None]:
    """(Granite's tensor name, half) for the decoder's HF-style `name`: half 0 or 1 for the
    gate or up rows of the fused `input_linear`, None for a whole tensor."""
    for ours, (theirs, half) in _MODULES.items():
        if ours in name:
            return name.replace(ours, theirs, 1), half
    return name, None


def get_granite(source, cfg: ArchConfig, name: str) -> np.ndarray:
    """The tensor the decoder calls `name`, read from a Granite checkpoint `source`.

    Raises:
        KeyError: The Granite tensor is absent.
        ValueError: A fused `input_linear` whose rows are not twice the shared MLP's width.
    """
    theirs, half = granite_name(name)
    arr = source.get(theirs)
    if half is None:
        return arr
    width = cfg.intermediate_size
    if arr.shape[0] != 2 * width:
        raise ValueError(f"tensor {theirs!r} has {arr.shape[0]} rows, expected 2 x "
                         f"shared_intermediate_size = {2 * width} for {cfg.architecture}")
    return arr[half * width:(half + 1) * width]

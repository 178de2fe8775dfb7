"""gpt-oss's checkpoint names for the decoder's tensors: the router (`mlp.router`, the
decoder's `mlp.gate`) and the routed experts, every expert of a layer in one stacked tensor:
`mlp.experts.gate_up_proj` [E, H, 2 I] with gate and up INTERLEAVED along the last axis
(gate the even columns, up the odd ones: transformers' `GptOssExperts._apply_gate`) and
`gate_up_proj_bias` [E, 2 I] the same way, `down_proj` [E, I, H] and `down_proj_bias`
[E, H] (stored [in, out], unlike a Linear's [out, in]). The MXFP4 checkpoints store the
stacks as `*_blocks`/`*_scales` instead (`models.loaders.quant_formats.gpt_oss`)."""

from __future__ import annotations

import re

import numpy as np

from models.loaders.stacked_experts import StackedExpertsSource

ARCHITECTURE = "GptOssForCausalLM"
# One routed expert's tensor as `models.loaders.hf_names.family_hf_name` names it.
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
# The decoder's projection -> (gpt-oss's stacked tensor, which columns: None all, else the
# first of every two).
STACKS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "down_proj": ("down_proj", None)}


def is_gpt_oss(cfg) -> bool:
    """Whether `cfg` (an `ArchConfig`) is gpt-oss's."""
    return cfg.architecture == ARCHITECTURE


def expert_tensor(name: str) -> tuple[str, int, str, int | None] | None:
    """(stacked tensor name without `_bias`/`_blocks`, expert, leaf "weight" or "bias",
    column parity or None) of a routed expert's per-expert name, None for another name."""
    found = EXPERT.match(name)
    if found is None:
        return None
    stem, expert, proj, leaf = found.groups()
    stacked, parity = STACKS[proj]
    return f"{stem}.{stacked}", int(expert), leaf, parity


class GptOssSource(StackedExpertsSource):
    """A `TensorSource` serving the decoder's per-expert names (`model.layers.{i}.mlp.
    experts.{e}.gate_proj.weight` [I, H] as a Linear stores it, `.bias` [I]) and the router
    (`mlp.gate.*`) from a gpt-oss checkpoint; other names pass through. The last stacked
    tensor read is kept, so a layer's E experts read it once.

    Args:
        source: The checkpoint's tensors.
    """

    def get(self, name: str) -> np.ndarray:
        found = expert_tensor(name)
        if found is None:
            return self.source.get(name.replace(".mlp.gate.", ".mlp.router.", 1))
        stacked, expert, leaf, parity = found
        arr = self.stacked(stacked + ("_bias" if leaf == "bias" else ""))[expert]
        cols = slice(None) if parity is None else slice(parity, None, 2)
        if leaf == "bias":  # [2 I] or [H]
            return arr[cols]
        return np.ascontiguousarray(arr[:, cols].T)  # [in, out] -> a Linear's [out, in]

    def where(self, name: str) -> str:
        found = expert_tensor(name)
        if found is None:
            return self.source.where(name.replace(".mlp.gate.", ".mlp.router.", 1))
        return self.source.where(found[0] + ("_bias" if found[2] == "bias" else ""))

"""Gemma 4's MoE block tensors under the decoder's names: the block's weights live in the
layer's `mlp` scope (`models.gemma4_moe`), transformers keeps the router, experts and the
block's three norms on the layer itself, and stacks each layer's experts:
`experts.gate_up_proj` [E, 2 I, H] (gate the FIRST I rows, up the last I: transformers'
`Gemma4TextExperts`, `.chunk(2, dim=-1)` of its output) and `experts.down_proj` [E, H, I],
both stored [out, in] as a Linear's weight."""

from __future__ import annotations

import re

import numpy as np

from models.loaders.stacked_experts import StackedExpertsSource

# One routed expert's tensor as `models.loaders.hf_names.family_hf_name` names it.
EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
                    r"\.weight$")
# The block's other tensors the decoder keeps under `mlp` and transformers on the layer.
MOVED = re.compile(r"^(model\.layers\.\d+\.)mlp\.((?:router|pre_feedforward_layernorm_2|"
                   r"post_feedforward_layernorm_1|post_feedforward_layernorm_2)\..+)$")


def checkpoint_name(name: str) -> str:
    """The checkpoint's name of a decoder tensor that is not a routed expert's."""
    found = MOVED.match(name)
    return name if found is None else found[1] + found[2]


class Gemma4MoESource(StackedExpertsSource):
    """A `TensorSource` serving the decoder's names of a Gemma 4 MoE block
    (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [I, H], `mlp.router.proj.weight`,
    ...) from the checkpoint's (above); other names pass through. The last stacked tensor
    read is kept, so a layer's E experts read it once.

    Args:
        source: The checkpoint's tensors.
        cfg: Its `ArchConfig` (`moe_intermediate_size` splits gate from up).
    """

    def __init__(self, source, cfg):
        super().__init__(source)
        self.cfg = cfg

    @staticmethod
    def _expert(name: str) -> tuple[str, int, str] | None:
        """(stacked tensor name, expert, projection) of a routed expert's name, else None."""
        found = EXPERT.match(name)
        if found is None:
            return None
        layer, expert, proj = found.groups()
        stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
        return f"{layer}.experts.{stacked}", int(expert), proj

    def get(self, name: str) -> np.ndarray:
        found = self._expert(name)
        if found is None:
            return self.source.get(checkpoint_name(name))
        stacked, expert, proj = found
        arr = self.stacked(stacked)[expert]  # [2 I, H] or [H, I]
        if proj == "down_proj":
            return arr
        width = self.cfg.moe_intermediate_size
        if arr.shape[0] != 2 * width:
            raise ValueError(f"tensor {stacked!r} in {self.source.where(stacked)} has "
                             f"{arr.shape[0]} rows per expert, expected 2 x "
                             f"moe_intermediate_size = {2 * width} (gate, then up)")
        return arr[:width] if proj == "gate_proj" else arr[width:]

    def where(self, name: str) -> str:
        found = self._expert(name)
        return self.source.where(checkpoint_name(name) if found is None else found[0])

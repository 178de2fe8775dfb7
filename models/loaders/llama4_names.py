"""Llama 4's checkpoint names for the decoder's tensors: the MLP is `feed_forward` (its
router `feed_forward.router`, the decoder's `mlp.gate`), and a layer's routed experts are
stacked: `feed_forward.experts.gate_up_proj` [E, H, 2 I] with gate the FIRST I columns and
up the last I (transformers' `Llama4TextExperts`: `gate_up.chunk(2, dim=-1)`), and
`down_proj` [E, I, H], both stored [in, out], unlike a Linear's [out, in]."""

from __future__ import annotations

import re

import numpy as np

from models.loaders.stacked_experts import StackedExpertsSource

ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
# One routed expert's tensor as `models.loaders.hf_names.family_hf_name` names it.
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_llama4(cfg) -> bool:
    """Whether `cfg` (an `ArchConfig`) is Llama 4's."""
    return cfg.architecture in ARCHITECTURES


def checkpoint_name(name: str) -> str:
    """The checkpoint's name of a decoder tensor that is not a routed expert's."""
    name = name.replace(".mlp.", ".feed_forward.", 1)
    return name.replace(".feed_forward.gate.", ".feed_forward.router.", 1)


class Llama4Source(StackedExpertsSource):
    """A `TensorSource` serving the decoder's names (`model.layers.{i}.mlp.experts.{e}.
    gate_proj.weight` [I, H] as a Linear stores it, the router as `mlp.gate.weight`, the
    MLPs under `mlp.`) from a Llama 4 checkpoint. The last stacked tensor read is kept, so
    a layer's E experts read it once.

    Args:
        source: The checkpoint's tensors.
    """

    @staticmethod
    def _expert(name: str) -> tuple[str, int, str] | None:
        found = EXPERT.match(name)
        if found is None:
            return None
        stem, expert, proj = found.groups()
        stacked = "gate_up_proj" if proj != "down_proj" else "down_proj"
        return checkpoint_name(f"{stem}.{stacked}"), int(expert), proj

    def get(self, name: str) -> np.ndarray:
        found = self._expert(name)
        if found is None:
            return self.source.get(checkpoint_name(name))
        stacked, expert, proj = found
        arr = self.stacked(stacked)[expert]  # [H, 2 I] or [I, H]
        if proj != "down_proj":
            if arr.shape[1] % 2:
                raise ValueError(f"tensor {stacked!r} in {self.source.where(stacked)} has "
                                 f"{arr.shape[1]} columns per expert: gate and up need an "
                                 "even number")
            half = arr.shape[1] // 2
            arr = arr[:, :half] if proj == "gate_proj" else arr[:, half:]
        return np.ascontiguousarray(arr.T)  # [in, out] -> a Linear's [out, in]

    def where(self, name: str) -> str:
        found = self._expert(name)
        return self.source.where(checkpoint_name(name) if found is None else found[0])

"""Gemma 4's checkpoint tensors as the one layer scan reads them: the tensors a layer lacks
served as what makes them unused, and the double-wide MLP's narrow layers padded.

The scan needs every layer to have the same parameters, but transformers saves none of
`k_proj`, `v_proj`, `k_norm` for the KV-shared layers (they read their source's KV; the
decoder writes nothing for them) and no `v_proj` for the full-attention layers of an
`attention_k_eq_v` model (their values are the key projection: `models.gemma4.values_of`).
Those come as zeros (norm weights as ones). With `use_double_wide_mlp` the shared layers'
MLPs are twice as wide as the others': the others' gate/up rows and down columns are padded
with zeros to that width (the tanh GELU of 0 is 0, so the padding adds nothing).
"""

from __future__ import annotations

import re

import numpy as np

ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$")


def is_gemma4(cfg) -> bool:
    """Whether `cfg` (an `ArchConfig`) is Gemma 4's."""
    return cfg.architecture in ARCHITECTURES


class Gemma4Source:
    """A `TensorSource` over a Gemma 4 checkpoint serving the decoder's names (above).

    Args:
        source: The checkpoint's tensors.
        cfg: Its `ArchConfig`.
    """

    def __init__(self, source, cfg):
        self.source = source
        self.cfg = cfg

    def _absent(self, layer: int, module: str, proj: str) -> np.ndarray | None:
        """What stands in for a tensor the checkpoint lacks by design, else None."""
        cfg = self.cfg
        shared = layer >= cfg.num_layers - cfg.kv_shared_layers
        full = cfg.layer_windows[layer] == 0
        kv_heads, head_dim = cfg.num_kv_heads, cfg.head_dim
        if full and cfg.has_global_heads:  # `models.gemma4_heads`
            kv_heads = cfg.global_kv_heads or kv_heads
            head_dim = cfg.global_head_dim or head_dim
        kv = kv_heads * head_dim
        if module != "self_attn":
            return None
        if shared and proj in ("k_proj", "v_proj"):
            return np.zeros((kv, cfg.hidden_size), np.float32)
        if shared and proj == "k_norm":
            return np.ones((head_dim,), np.float32)
        if cfg.attention_k_eq_v and full and proj == "v_proj":
            return np.zeros((kv, cfg.hidden_size), np.float32)
        return None

    def get(self, name: str) -> np.ndarray:
        found = _LAYER.match(name)
        try:
            arr = self.source.get(name)
        except KeyError:
            stand_in = None if found is None else self._absent(int(found[1]), found[2],
                                                                found[3])
            if stand_in is None:
                raise
            return stand_in
        cfg = self.cfg
        if found is None or not cfg.double_wide_mlp or found[2] != "mlp":
            return arr
        wide = cfg.intermediate_size
        if found[3] == "down_proj" and arr.shape[1] * 2 == wide:  # [H, I] -> [H, 2 I]
            return np.concatenate([arr, np.zeros_like(arr)], axis=1)
        if found[3] in ("gate_proj", "up_proj") and arr.shape[0] * 2 == wide:  # [I, H]
            return np.concatenate([arr, np.zeros_like(arr)], axis=0)
        return arr

    def where(self, name: str) -> str:
        return self.source.where(name)

"""Loads a target checkpoint's MTP layer (`models.mtp`) beside the loaded target.

The layer's decoder tensors (`model.layers.{L}.self_attn.*`, `.mlp.*`, its norms) fill a
one-layer decoder's params tree through the target's own name mapping (`build_params`), read
as layer 0 of it; `shared_head.norm` serves as that decoder's final norm. `enorm`, `hnorm`,
`eh_proj` and `shared_head.head` (optional: the target's LM head otherwise) are read
directly. The checkpoint's copy of the embedding (`model.layers.{L}.embed_tokens`) is not
read: the draft shares the target's.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from models.linear import ServingChoice
from models.loaders.checkpoint_quant import checkpoint_format
from models.loaders.hf_names import build_params
from models.loaders.safetensors_dir import SafetensorsDir, read_config
from models.model import Model, abstract_params
from models.mtp import MTP_ARCHITECTURES, MtpHead, block_config

_METHOD = "speculative_config.method"
_MODEL = "speculative_config.model"


class _LayerSource:
    """The checkpoint's tensors as the one-layer decoder names them: layer 0 is layer
    `layer`, the final norm `shared_head.norm`, the (never read) embedding one zero row."""

    def __init__(self, source: SafetensorsDir, layer: int, hidden_size: int):
        self.source, self.prefix, self.hidden_size = source, f"model.layers.{layer}.", hidden_size

    def _name(self, name: str) -> str:
        if name == "model.norm.weight":
            return self.prefix + "shared_head.norm.weight"
        return name.replace("model.layers.0.", self.prefix, 1)

    def get(self, name: str) -> np.ndarray:
        if name == "model.embed_tokens.weight":
            return np.zeros((1, self.hidden_size), np.float32)
        return self.source.get(self._name(name))

    def where(self, name: str) -> str:
        return f"{self.source.where(self._name(name))} (the MTP layer {self.prefix}*)"


def load_mtp(target: Model, path: str | None = None) -> MtpHead:
    """The first MTP layer of checkpoint directory `path` (default: the target's source),
    in the target's dtype, on the default device.

    Raises:
        ValueError: A family without MTP layers, no checkpoint directory, a checkpoint
            without the layer (`num_nextn_predict_layers` 0 or its tensors absent), a
            quantized checkpoint, or a tensor of the wrong shape (each names its field).
    """
    cfg = target.cfg
    if cfg.architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"{_METHOD}: mtp drafts with the MTP layers of "
                         f"{', '.join(MTP_ARCHITECTURES)} checkpoints; {cfg.architecture} "
                         "has none")
    path = path or target.source
    if not path or not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{_MODEL}: no checkpoint directory at {path!r} to read the MTP "
                         "layers from (the target's own by default)")
    layer, hf = cfg.num_layers, read_config(path)
    src = SafetensorsDir(path)
    names, prefix = set(src.names()), f"model.layers.{layer}."
    num = hf.get("num_nextn_predict_layers") or 0
    if not num or prefix + "eh_proj.weight" not in names:
        raise ValueError(f"{_METHOD}: {path} holds no MTP layer (num_nextn_predict_layers="
                         f"{num}; no {prefix}eh_proj.weight)")
    if checkpoint_format(path, cfg) is not None:
        raise ValueError(f"{_MODEL}: {path} is quantized; MTP layers are read from float "
                         "checkpoints only")
    mcfg, h, dtype = block_config(cfg), cfg.hidden_size, target.dtype
    host = build_params(mcfg, abstract_params(mcfg, dtype), _LayerSource(src, layer, h), dtype)
    shapes = {"enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h),
              "shared_head.head": (cfg.vocab_size, h)}
    extra = {}
    for name, want in shapes.items():
        full = f"{prefix}{name}.weight"
        if full not in names:
            if name == "shared_head.head":
                continue  # the target's LM head
            raise ValueError(f"{_METHOD}: {path} has no {full!r}")
        value = src.get(full)
        if value.shape != want:
            raise ValueError(f"{_MODEL}: {full} of {path} is {value.shape}; the target makes "
                             f"it {want}")
        extra[name.removeprefix("shared_head.")] = jnp.asarray(value.astype(np.float32), dtype)
    block = Model(mcfg, jax.device_put(host), dtype, source=path,
                  serving=ServingChoice("xla"))
    return MtpHead(block, {"block": block.params, **extra}, layer, cfg.rms_norm_eps, path)

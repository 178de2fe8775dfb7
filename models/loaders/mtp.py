"""Loads a target checkpoint's MTP layer (`models.mtp`) beside the loaded target.

The layer's decoder tensors (DeepSeek: `model.layers.{L}.self_attn.*`, `.mlp.*`, its norms;
Qwen3-Next / Qwen3.5: `mtp.layers.0.*`; `models.mtp_layouts`) fill a one-layer decoder's
params tree through the target's own name mapping (`build_params`), read as layer 0 of it;
the MTP layer's final norm (`shared_head.norm`, `mtp.norm`) serves as that decoder's final
norm. The two norms before `eh_proj`, `eh_proj` itself and DeepSeek's optional
`shared_head.head` (the target's LM head otherwise) are read directly. A checkpoint's copy of
the embedding (DeepSeek's `model.layers.{L}.embed_tokens`) is not read: the draft shares the
target's.
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
from models.mtp_layouts import LAYOUTS, MtpLayout

_METHOD = "speculative_config.method"
_MODEL = "speculative_config.model"


class _LayerSource:
    """The checkpoint's tensors as the one-layer decoder names them: layer 0 is the MTP
    layer (`block`, its decoder tensors' prefix), the final norm the MTP layer's (`norm`),
    the (never read) embedding one zero row."""

    def __init__(self, source: SafetensorsDir, block: str, norm: str, hidden_size: int):
        self.source, self.prefix, self.norm = source, block, norm
        self.hidden_size = hidden_size

    def _name(self, name: str) -> str:
        if name == "model.norm.weight":
            return self.norm
        return name.replace("model.layers.0.", self.prefix, 1)

    def get(self, name: str) -> np.ndarray:
        if name == "model.embed_tokens.weight":
            return np.zeros((1, self.hidden_size), np.float32)
        return self.source.get(self._name(name))

    def where(self, name: str) -> str:
        return f"{self.source.where(self._name(name))} (the MTP layer {self.prefix}*)"


def num_mtp_layers(hf: dict, layout: MtpLayout) -> int | None:
    """The config's MTP layer count (its first `count_keys` entry, in the config or its
    `text_config`); None where it names none."""
    for config in (hf, hf.get("text_config") or {}):
        for key in layout.count_keys:
            if config.get(key) is not None:
                return int(config[key])
    return None


def load_mtp(target: Model, path: str | None = None) -> MtpHead:
    """The first MTP layer of checkpoint directory `path` (default: the target's source),
    in the target's dtype, on the default device.

    Raises:
        ValueError: A family without MTP layers, no checkpoint directory, a checkpoint
            without the layer (a layer count of 0 in its config, or its `eh_proj` tensor
            absent), a quantized checkpoint, or a tensor of the wrong shape (each names its
            field).
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
    layout, layer = LAYOUTS[cfg.architecture], cfg.num_layers
    src = SafetensorsDir(path)
    names, num = set(src.names()), num_mtp_layers(read_config(path), layout)
    fc = layout.tensor("eh_proj", layer)
    if num == 0 or fc not in names:
        raise ValueError(f"{_METHOD}: {path} holds no MTP layer ({'/'.join(layout.count_keys)}"
                         f"={num}; no {fc})")
    if checkpoint_format(path, cfg) is not None:
        raise ValueError(f"{_MODEL}: {path} is quantized; MTP layers are read from float "
                         "checkpoints only")
    mcfg, h, dtype = block_config(cfg), cfg.hidden_size, target.dtype
    source = _LayerSource(src, layout.block(layer), layout.tensor("norm", layer), h)
    host = build_params(mcfg, abstract_params(mcfg, dtype), source, dtype)
    shapes = {"enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h), "head": (cfg.vocab_size, h)}
    extra = {}
    for role, want in shapes.items():
        if role not in layout.names:
            continue
        full = layout.tensor(role, layer)
        if full not in names:
            if role == "head":
                continue  # the target's LM head
            raise ValueError(f"{_METHOD}: {path} has no {full!r}")
        value = src.get(full)
        if value.shape != want:
            raise ValueError(f"{_MODEL}: {full} of {path} is {value.shape}; the target makes "
                             f"it {want}")
        extra[role] = jnp.asarray(value.astype(np.float32), dtype)
    block = Model(mcfg, jax.device_put(host), dtype, source=path,
                  serving=ServingChoice("xla"))
    return MtpHead(block, {"block": block.params, **extra}, layer, cfg.rms_norm_eps, layout,
                   path)

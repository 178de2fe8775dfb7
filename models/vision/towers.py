"""The vision tower of an image-text checkpoint, found from its config.json: which family it
is, its weights, and the function that turns a batch of preprocessed images into the rows
their placeholders take."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from models.loaders.safetensors_dir import read_config
from models.vision import qwen2_5_vl, siglip

# Families whose tower the engine serves, by their checkpoint's architecture.
GEMMA3 = "Gemma3ForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
SERVED = (GEMMA3, QWEN2_5_VL)


@dataclasses.dataclass
class VisionTower:
    """A loaded vision tower.

    Attributes:
        architecture: The checkpoint's architecture (one of `SERVED`).
        cfg: The tower's config (`siglip.SiglipConfig` for Gemma 3,
            `qwen2_5_vl.QwenVisionConfig` for Qwen2.5-VL).
        params: Its weights (a pytree of device arrays).
        hf_config: The checkpoint's config.json (image token ids, sizes).
    """

    architecture: str
    cfg: object
    params: dict
    hf_config: dict

    @property
    def hidden_size(self) -> int:
        """Width of the rows it makes (the text model's hidden size)."""
        if self.architecture == QWEN2_5_VL:
            return self.cfg.out_hidden_size
        return self.cfg.text_hidden_size

    @property
    def dtype(self):
        return jax.tree_util.tree_leaves(self.params)[0].dtype

    def encode(self, inputs) -> jax.Array:
        """The rows of one preprocessed image (`ImageInputs`): [num_tokens, hidden_size]
        (one compile per image size)."""
        if self.architecture == QWEN2_5_VL:
            return qwen2_5_vl.encode_images(self.params, self.cfg,
                                            jnp.asarray(inputs.pixel_values),
                                            (tuple(inputs.grid_thw),))
        return _encode_siglip(self.params, self.cfg, jnp.asarray(inputs.pixel_values)[None])[0]


_encode_siglip = jax.jit(siglip.encode_images, static_argnums=1)


def read_hf_config(path: str) -> dict | None:
    """A directory's config.json (`read_config`), or None (a GGUF file, no file)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    return read_config(path)


def load_vision(hf: dict, source, dtype=jnp.float32) -> VisionTower | None:
    """The tower of a checkpoint (its config.json `hf`, its tensors in `source`, a
    `TensorSource`), or None when its architecture has no tower the engine serves.

    Raises:
        ValueError: A tower config it cannot serve, or a tensor of the wrong shape (named).
        KeyError: A tower tensor is missing (its name).
    """
    arch = (hf.get("architectures") or [None])[0]
    if arch not in SERVED:
        return None
    if arch == QWEN2_5_VL:
        cfg = qwen2_5_vl.QwenVisionConfig.from_hf(hf.get("vision_config") or {})
        return VisionTower(arch, cfg, qwen2_5_vl.load_qwen_vision(source, cfg, dtype=dtype), hf)
    cfg = siglip.SiglipConfig.from_hf(hf)
    return VisionTower(arch, cfg, siglip.load_siglip(source, cfg, dtype), hf)

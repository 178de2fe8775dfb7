"""Image preprocessing without torch, as the transformers processors of the served families
do it: Gemma 3's (SigLIP: a square resize) and Qwen2-VL/Qwen2.5-VL's (`smart_resize` to a
multiple of the merged patch, then patches flattened in the vision tower's order).

Each processor reads its settings from the model directory's `preprocessor_config.json`
(transformers' defaults where it is silent) and turns an RGB PIL image into `ImageInputs`:
the pixel array the vision encoder takes and how many placeholder tokens the image fills.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2-VL's normalisation
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """One image ready for the vision encoder.

    Attributes:
        pixel_values: Gemma 3: f32[3, S, S]; Qwen2-VL: f32[grid_h * grid_w, C * T * P * P]
            (its patches, each merge window's together).
        num_tokens: Placeholder tokens the image takes in the prompt.
        grid_thw: Qwen2-VL's (t, h, w) patch grid; None for Gemma 3.
    """

    pixel_values: np.ndarray
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None


def _rescale_normalize(image: Image.Image, scale: float, mean, std) -> np.ndarray:
    """f32[3, H, W]: RGB bytes times `scale`, minus `mean`, over `std` (per channel)."""
    x = np.asarray(image, dtype=np.float64).transpose(2, 0, 1) * scale  # [3, H, W]
    x = x.astype(np.float32)
    mean = np.asarray(mean, np.float32)[:, None, None]
    std = np.asarray(std, np.float32)[:, None, None]
    return ((x - mean) / std).astype(np.float32)


def read_preprocessor_config(model_dir: str | None) -> dict:
    """The model directory's `preprocessor_config.json`, or {} when it has none."""
    path = None if model_dir is None else os.path.join(model_dir, "preprocessor_config.json")
    if path is None or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class Gemma3Processor:
    """Gemma 3's image preprocessing (transformers' `Gemma3ImageProcessor`): bilinear resize
    to `size` x `size`, rescale, normalise to [-1, 1]; `tokens` soft tokens per image.

    Raises (from `from_config`):
        ValueError: `do_pan_and_scan` (crops per image) is not served.
    """

    size: int = 896
    tokens: int = 256
    resample: int = Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_config(cls, pre: dict, tokens_per_image: int) -> Gemma3Processor:
        if pre.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config.json: do_pan_and_scan (several crops per "
                             "image) is not served")
        size = pre.get("size") or {}
        side = int(size.get("height", cls.size))
        if int(size.get("width", side)) != side:
            raise ValueError(f"preprocessor_config.json: size {size} is not square")
        return cls(size=side, tokens=tokens_per_image,
                   resample=int(pre.get("resample", cls.resample)),
                   rescale_factor=float(pre.get("rescale_factor", cls.rescale_factor)),
                   mean=tuple(pre.get("image_mean", cls.mean)),
                   std=tuple(pre.get("image_std", cls.std)))

    def __call__(self, image: Image.Image) -> ImageInputs:
        resized = image.convert("RGB").resize((self.size, self.size), self.resample)
        pixels = _rescale_normalize(resized, self.rescale_factor, self.mean, self.std)
        return ImageInputs(pixels, self.tokens)


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: each side a multiple of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as near as that allows.

    Raises:
        ValueError: An aspect ratio over 200 (as transformers).
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f}"
                         " is over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class QwenVLProcessor:
    """Qwen2-VL and Qwen2.5-VL's image preprocessing (transformers' `Qwen2VLImageProcessor`):
    bicubic `smart_resize` to multiples of `patch_size * merge_size`, rescale, CLIP
    normalisation, then patches of `patch_size`, each repeated `temporal_patch_size` times,
    ordered merge window by merge window; an image takes one token per merged window."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_config(cls, pre: dict) -> QwenVLProcessor:
        size = pre.get("size") or {}
        return cls(patch_size=int(pre.get("patch_size", cls.patch_size)),
                   merge_size=int(pre.get("merge_size", cls.merge_size)),
                   temporal_patch_size=int(pre.get("temporal_patch_size",
                                                   cls.temporal_patch_size)),
                   min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge")
                                  or cls.min_pixels),
                   max_pixels=int(pre.get("max_pixels") or size.get("longest_edge")
                                  or cls.max_pixels),
                   resample=int(pre.get("resample", cls.resample)),
                   rescale_factor=float(pre.get("rescale_factor", cls.rescale_factor)),
                   mean=tuple(pre.get("image_mean", cls.mean)),
                   std=tuple(pre.get("image_std", cls.std)))

    def __call__(self, image: Image.Image) -> ImageInputs:
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        h, w = smart_resize(image.height, image.width, p * m, self.min_pixels, self.max_pixels)
        resized = image.convert("RGB").resize((w, h), self.resample)
        x = _rescale_normalize(resized, self.rescale_factor, self.mean, self.std)  # [C, H, W]
        gh, gw = h // p, w // p
        x = x.reshape(3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        patches = np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p)
        return ImageInputs(patches, gh * gw // (m * m), (1, gh, gw))

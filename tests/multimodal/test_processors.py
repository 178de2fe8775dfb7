"""Image preprocessing (`jaxserve.multimodal.processors`) equals transformers' own
processors' pixel values (their PIL backends: torchvision is not installed) for images of
several sizes and aspect ratios, and the placeholder counts their processors give."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal.processors import Gemma3Processor, QwenVLProcessor, smart_resize

transformers = pytest.importorskip("transformers")


def image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A random image (noise plus a gradient, so resampling has edges and ramps)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    arr = np.clip(ramp * 0.5 + rng.integers(0, 128, (height, width, 3)), 0, 255)
    return Image.fromarray(arr.astype(np.uint8)).convert(mode)


@pytest.mark.parametrize("size", [(40, 30), (17, 64), (224, 224)])
def test_gemma3_pixels_equal_transformers(size):
    theirs = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    ours = Gemma3Processor.from_config(theirs.to_dict(), tokens_per_image=16)
    img = image(*size, seed=size[0])
    want = theirs(images=[img], return_tensors="np")["pixel_values"][0]
    got = ours(img)
    assert got.pixel_values.shape == want.shape == (3, 32, 32)
    np.testing.assert_allclose(got.pixel_values, want, atol=1e-6)
    assert got.num_tokens == 16 and got.grid_thw is None


def test_gemma3_refuses_pan_and_scan():
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        Gemma3Processor.from_config({"do_pan_and_scan": True}, 256)
    with pytest.raises(ValueError, match="not square"):
        Gemma3Processor.from_config({"size": {"height": 32, "width": 48}}, 256)


@pytest.mark.parametrize("size", [(60, 45), (33, 120), (300, 200), (10, 10)])
def test_qwen_vl_patches_equal_transformers(size):
    theirs = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 40})
    ours = QwenVLProcessor.from_config(theirs.to_dict())
    img = image(*size, seed=size[1], mode="L")  # a grey image becomes RGB on both sides
    out = theirs(images=[img], return_tensors="np")
    got = ours(img.convert("RGB"))
    assert got.pixel_values.shape == out["pixel_values"].shape
    np.testing.assert_allclose(got.pixel_values, out["pixel_values"], atol=1e-6)
    assert list(got.grid_thw) == out["image_grid_thw"][0].tolist()
    _, gh, gw = got.grid_thw
    assert got.num_tokens == gh * gw // 4
    assert 4 <= got.num_tokens <= 40  # the pixel limits in merged tokens


def test_smart_resize_limits_and_aspect_ratio():
    assert smart_resize(1000, 1000, 28, 56 * 56, 28 * 28 * 100) == (280, 280)
    h, w = smart_resize(10, 20, 28, 28 * 28 * 8, 28 * 28 * 100)
    assert h % 28 == w % 28 == 0 and h * w >= 28 * 28 * 8
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 28, 56 * 56, 28 * 28 * 100)

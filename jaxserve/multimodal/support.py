"""What an engine needs to take images into prompts for its model: the family's marker and
placeholder tokens (`ImageLayout`), its preprocessing, the limits; and the step from a
prompt with `multi_modal_data` to token ids and image items."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.multimodal.inputs import ImageItem, ImageLayout, expand_prompt
from jaxserve.multimodal.media import MediaLimits, load_image
from jaxserve.multimodal.processors import (
    Gemma3Processor,
    QwenVLProcessor,
    read_preprocessor_config,
)
from models.mrope import mrope_positions

GEMMA3 = "Gemma3ForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
DEFAULT_MAX_IMAGES = 999  # vLLM's default `limit_mm_per_prompt` is per modality, unbounded


@dataclasses.dataclass(frozen=True)
class ImageSupport:
    """A model's way with images.

    Attributes:
        layout: Its markers and placeholders.
        processor: Its preprocessing (an image -> `ImageInputs`).
        limits: What an image may be.
        max_images: Most images in one prompt (`limit_mm_per_prompt["image"]`).
    """

    layout: ImageLayout
    processor: object
    limits: MediaLimits = MediaLimits()
    max_images: int = DEFAULT_MAX_IMAGES
    mrope: tuple | None = None  # Qwen2-VL: (image token id, spatial merge size)

    @property
    def max_image_tokens(self) -> int:
        """Placeholders of the largest image the processor makes."""
        proc = self.processor
        if isinstance(proc, QwenVLProcessor):
            return proc.max_pixels // (proc.patch_size * proc.merge_size) ** 2
        return proc.tokens

    def rope_positions(self, ids: list[int], items) -> tuple[np.ndarray, int] | None:
        """A prompt's multimodal rotary rows and the later tokens' shift (`models.mrope`),
        for a family with them; None for others."""
        if self.mrope is None:
            return None
        token, merge = self.mrope
        return mrope_positions(ids, [item.inputs.grid_thw for item in items], token, merge)

    def prompt_items(self, prompt, images, tokenize) -> tuple[list[int], list[ImageItem]]:
        """Token ids and image items of a prompt (text or ids) with `images` (one image or
        a list: PIL images or URLs), each loaded, checked and preprocessed.

        Raises:
            ValueError: More images than `max_images`, a bad image (naming which), or
                markers that do not match the images.
        """
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.max_images:
            raise ValueError(f"multi_modal_data has {len(images)} images; limit_mm_per_prompt "
                             f"allows {self.max_images}")
        inputs = [self.processor(load_image(img, self.limits, f"multi_modal_data.image[{i}]"))
                  for i, img in enumerate(images)]
        return expand_prompt(prompt, inputs, self.layout, tokenize)


def image_support(hf_config: dict, tokenizer, model_dir: str, limits: MediaLimits | None = None,
                  max_images: int = DEFAULT_MAX_IMAGES) -> ImageSupport:
    """The `ImageSupport` of a served image-text checkpoint (its config.json `hf_config`).

    Raises:
        ValueError: An architecture whose images are not served, or a preprocessing
            setting that is not (named).
    """
    arch = (hf_config.get("architectures") or [None])[0]
    if arch == QWEN2_5_VL:
        pad = int(hf_config.get("image_token_id", 151_655))
        text = tokenizer.convert_ids_to_tokens(pad)
        processor = QwenVLProcessor.from_config(read_preprocessor_config(model_dir))
        merge = int((hf_config.get("vision_config") or {}).get("spatial_merge_size", 2))
        return ImageSupport(ImageLayout(text, pad, text, pad), processor,
                            limits or MediaLimits(), max_images, (pad, merge))
    if arch != GEMMA3:
        raise ValueError(f"images are not served for {arch}")
    boi = int(hf_config.get("boi_token_index", 255_999))
    eoi = int(hf_config.get("eoi_token_index", 256_000))
    image = int(hf_config.get("image_token_index", 262_144))
    text = tokenizer.convert_ids_to_tokens
    layout = ImageLayout(text(boi), boi, text(image), image, before="\n\n" + text(boi),
                         after=text(eoi) + "\n\n", bidirectional=True)
    processor = Gemma3Processor.from_config(read_preprocessor_config(model_dir),
                                            int(hf_config.get("mm_tokens_per_image", 256)))
    return ImageSupport(layout, processor, limits or MediaLimits(), max_images)

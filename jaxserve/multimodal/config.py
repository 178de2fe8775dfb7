"""`MultiModalConfig`: the engine arguments that say which images a prompt may carry (vLLM's
`limit_mm_per_prompt` and `allowed_local_media_path`, with the pixel, byte and fetch limits)."""

from __future__ import annotations

import dataclasses
import json
import os

from jaxserve.multimodal.media import MediaLimits

MODALITIES = ("image",)  # what prompts may carry
# vLLM's default `limit_mm_per_prompt`: per modality, in effect unbounded.
DEFAULT_LIMIT = 999


def _parse_limits(value) -> dict[str, int]:
    """`limit_mm_per_prompt` ({"image": N}, or its JSON text as the CLI gives it) as a dict
    with every served modality, unset ones at `DEFAULT_LIMIT`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt: not valid JSON ({e}); expected e.g. "
                             '\'{"image": 2}\'') from None
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be an object like {{\"image\": 2}}, got "
                         f"{value!r}")
    for key, count in value.items():
        if key not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: modality {key!r} is not served (only "
                             f"{', '.join(MODALITIES)})")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"limit_mm_per_prompt[{key!r}] must be a non-negative integer, "
                             f"got {count!r}")
    return {m: value.get(m, DEFAULT_LIMIT) for m in MODALITIES}


@dataclasses.dataclass(frozen=True)
class MultiModalConfig:
    """Which images a prompt may carry and where they may come from.

    Attributes:
        limit_mm_per_prompt: Most items of each modality in one prompt, vLLM's
            `{"image": N}` (or its JSON text); parsed to a dict holding every modality,
            unset ones at 999 (vLLM's default). 0 refuses images.
        allowed_local_media_path: A directory `file://` image URLs may read under (vLLM's
            flag; None: no local files). It must exist.
        max_image_pixels: Largest decoded image (width x height).
        max_image_bytes: Largest encoded image (a data URL's payload, a file, a download).
        image_fetch_timeout: Seconds an `http(s)` image download may take (vLLM's
            `VLLM_IMAGE_FETCH_TIMEOUT`).
        allow_http_images: Fetch `http(s)` image URLs at all (off on a host without a
            network, or to keep the server from making requests).
    """

    limit_mm_per_prompt: object = None
    allowed_local_media_path: str | None = None
    max_image_pixels: int = MediaLimits.max_pixels
    max_image_bytes: int = MediaLimits.max_bytes
    image_fetch_timeout: float = MediaLimits.fetch_timeout_s
    allow_http_images: bool = True

    def __post_init__(self):
        object.__setattr__(self, "limit_mm_per_prompt", _parse_limits(self.limit_mm_per_prompt))
        path = self.allowed_local_media_path
        if path is not None and (not isinstance(path, str) or not os.path.isdir(path)):
            raise ValueError(f"allowed_local_media_path must be an existing directory, got "
                             f"{path!r}")
        for name in ("max_image_pixels", "max_image_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        timeout = self.image_fetch_timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"image_fetch_timeout must be a positive number of seconds, got "
                             f"{timeout!r}")
        if not isinstance(self.allow_http_images, bool):
            raise ValueError(f"allow_http_images must be True or False, got "
                             f"{self.allow_http_images!r}")

    @property
    def max_images(self) -> int:
        """Most images in one prompt (`limit_mm_per_prompt["image"]`)."""
        return self.limit_mm_per_prompt["image"]

    def media_limits(self) -> MediaLimits:
        """What `jaxserve.multimodal.media.load_image` allows under this config."""
        return MediaLimits(allowed_local_media_path=self.allowed_local_media_path,
                           max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels,
                           fetch_timeout_s=float(self.image_fetch_timeout),
                           allow_http=self.allow_http_images)

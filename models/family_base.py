"""The base of a model family: how an HF `config.json` maps onto `ArchConfig`
(`models.registry` holds the families)."""

from __future__ import annotations

import logging
from typing import Any

from models.config import ArchConfig
from models.hf_fields import common_fields, partial_rotary_factor

logger = logging.getLogger("models.registry")  # the families' log, whichever file holds one


def text_config(hf: dict, towers: str = "vision tower is") -> dict:
    """The language model's config of a ForConditionalGeneration checkpoint (its
    `text_config`, under the checkpoint's architectures), logging that its `towers` (say
    "vision tower is") are not served; `hf` itself for a text-only checkpoint."""
    if "text_config" not in hf:
        return hf
    logger.info("%s: serving its language model only; the %s ignored",
                hf["architectures"][0], towers)
    return {**hf["text_config"], "architectures": hf["architectures"]}


class ModelFamily:
    """Base of a decoder family: turns an HF config dict into an `ArchConfig`."""

    architectures: tuple[str, ...] = ()
    partial_rotary = False  # whether its transformers class reads `partial_rotary_factor`

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> ArchConfig:
        """Builds the architecture config from a parsed HF `config.json`.

        Raises:
            ValueError: A field the family does not serve, named (as `partial_rotary_factor`
                below 1 for a family whose transformers class rotates the whole head).
        """
        factor = partial_rotary_factor(hf)
        if factor != 1.0 and not cls.partial_rotary:
            raise ValueError(f"unsupported partial_rotary_factor={factor} for "
                             f"{hf['architectures'][0]}: it rotates whole heads")
        return ArchConfig(**{**common_fields(hf), **cls.extra_fields(hf)})

    @classmethod
    def extra_fields(cls, hf: dict[str, Any]) -> dict[str, Any]:
        """The `ArchConfig` fields this family sets apart from (or over) `common_fields`."""
        return {}

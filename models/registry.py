"""Model families and the registry from HF `architectures` names to them.

Llama, Qwen2, Qwen3 and Mistral share one Flax decoder (`models.decoder.Decoder`); a
family only decides how its HF config maps onto `ArchConfig`.
"""

from __future__ import annotations

from typing import Any

from models.config import ArchConfig, common_fields, windows_from_layer_types


class ModelFamily:
    """Base of a decoder family: turns an HF config dict into an `ArchConfig`."""

    architectures: tuple[str, ...] = ()

    @classmethod
    def arch_config(cls, hf: dict[str, Any]) -> ArchConfig:
        """Builds the architecture config from a parsed HF `config.json`."""
        return ArchConfig(**common_fields(hf), **cls.extra_fields(hf))

    @classmethod
    def extra_fields(cls, hf: dict[str, Any]) -> dict[str, Any]:
        return {}


class Llama(ModelFamily):
    """Llama 2/3 and SmolLM2: optional attention/MLP bias, Llama 3 rope scaling."""

    architectures = ("LlamaForCausalLM",)

    @classmethod
    def extra_fields(cls, hf):
        bias = bool(hf.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


class Mistral(ModelFamily):
    """Mistral: sliding-window attention on every layer."""

    architectures = ("MistralForCausalLM",)

    @classmethod
    def extra_fields(cls, hf):
        # NOTE: transformers' Mistral ignores layer_types: the window applies to every layer.
        window = int(hf.get("sliding_window") or 0)
        return dict(layer_windows=(window,) * int(hf["num_hidden_layers"]))


class Qwen2(ModelFamily):
    """Qwen2: q/k/v bias; sliding window only on layers >= max_window_layers when enabled."""

    architectures = ("Qwen2ForCausalLM",)

    @classmethod
    def _windows(cls, hf):
        if hf.get("layer_types"):
            return windows_from_layer_types(hf)
        n = int(hf["num_hidden_layers"])
        if not hf.get("use_sliding_window") or not hf.get("sliding_window"):
            return (0,) * n
        first = int(hf.get("max_window_layers", n))
        return tuple(int(hf["sliding_window"]) if i >= first else 0 for i in range(n))

    @classmethod
    def extra_fields(cls, hf):
        return dict(qkv_bias=True, layer_windows=cls._windows(hf))


class Qwen3(Qwen2):
    """Qwen3: per-head RMSNorm on q and k before rotary, optional attention bias."""

    architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def extra_fields(cls, hf):
        bias = bool(hf.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, layer_windows=cls._windows(hf))


FAMILIES: dict[str, type[ModelFamily]] = {
    name: fam for fam in (Llama, Mistral, Qwen2, Qwen3) for name in fam.architectures
}


def family_for(hf: dict[str, Any]) -> type[ModelFamily]:
    """Returns the family for an HF config, or raises `ValueError` listing supported ones."""
    archs = hf.get("architectures") or []
    for name in archs:
        if name in FAMILIES:
            return FAMILIES[name]
    raise ValueError(
        f"unsupported architecture {archs or '(none given)'}; supported: "
        f"{', '.join(sorted(FAMILIES))}"
    )


def arch_config_from_hf(hf: dict[str, Any]) -> ArchConfig:
    """Parses an HF `config.json` dict into an `ArchConfig` through its family."""
    return family_for(hf).arch_config(hf)

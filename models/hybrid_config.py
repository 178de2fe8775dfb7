"""The config fields of linear-attention hybrids (Qwen3-Next, Qwen3.5): which layers are Gated
DeltaNet, their head counts and widths, and the gated full attention beside them."""

from __future__ import annotations

from typing import Any

from models.config import HYBRID_LAYER_TYPES

# transformers' Qwen3-Next / Qwen3.5 configs set this when the checkpoint's config omits it.
DEFAULT_PARTIAL_ROTARY = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def hybrid_layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's kind: `layer_types`, else every `full_attention_interval`-th layer full
    attention and the rest linear (transformers' default pattern).

    Raises:
        ValueError: An entry that is not one of `HYBRID_LAYER_TYPES`, another count than
            `num_hidden_layers`, or an interval below 1.
    """
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        interval = hf.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"full_attention_interval={interval!r} must be an integer >= 1")
        return ["linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(n)]
    return check_layer_types(hf, types, HYBRID_LAYER_TYPES)


def check_layer_types(hf: dict[str, Any], types: list[str], supported) -> list[str]:
    """`types` (a config's `layer_types`) as a list, each entry one of `supported` (names, or
    a mapping from a family's names to the decoder's).

    Raises:
        ValueError: An entry not in `supported`, or another count than `num_hidden_layers`.
    """
    n = int(hf["num_hidden_layers"])
    for t in types:
        if t not in supported:
            raise ValueError(f"unsupported layer_types entry {t!r} for "
                             f"{hf['architectures'][0]}; supported: "
                             f"{', '.join(supported)}")
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    return list(types)


def with_hybrid_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """The config with transformers' defaults these families add: a partial rotary of a
    quarter of each head when neither the rope parameters nor the config set one."""
    params = hf.get("rope_parameters") or {}
    if params.get("partial_rotary_factor") is None and hf.get("partial_rotary_factor") is None:
        return {**hf, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY}
    return hf


def linear_attention_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The `ArchConfig` fields every Qwen3-Next / Qwen3.5 text model shares: Gated DeltaNet
    layers (`linear_layers` and their shapes), gated full attention with per-head q/k norms
    and `attention_bias`, and zero-centred RMSNorms (`1 + weight`, transformers'
    `GemmaRMSNorm`; the gated norm inside a linear layer multiplies by its weight alone).

    Raises:
        ValueError: A bad `layer_types` (`hybrid_layer_types`), or a linear field missing.
    """
    types = hybrid_layer_types(hf)
    fields: dict[str, Any] = {}
    for name, default in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32),
                          ("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
                          ("linear_conv_kernel_dim", 4)):
        value = hf.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name}={value!r} for {hf['architectures'][0]} must be an integer")
        fields[name] = value
    bias = bool(hf.get("attention_bias", False))
    return dict(fields, linear_layers=tuple(i for i, t in enumerate(types)
                                            if t == "linear_attention"),
                attn_output_gate=True, qk_norm=True, qkv_bias=bias, o_bias=bias,
                norm_offset=1.0)

"""The `config.json` fields every supported family spells the same way, read into
`models.config.ArchConfig` fields (the families add their own in `models.registry`)."""

from __future__ import annotations

from typing import Any

from models.config import LAYER_TYPES, SUPPORTED_ACTIVATIONS
from models.rope import parse_rope


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """HF's `partial_rotary_factor`: the rope parameters' first (transformers lets them
    override the top-level field), 1.0 when neither sets it."""
    params = hf.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor")
    if value is None:
        value = hf.get("partial_rotary_factor")
    return 1.0 if value is None else float(value)


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def common_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The config fields every supported family spells the same way."""
    act_field = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
    act = hf.get(act_field) or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported {act_field} {act!r}; supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    num_heads = int(hf["num_attention_heads"])
    theta, scaling = parse_rope(hf)
    return dict(
        architecture=hf["architectures"][0],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
        hidden_act=act,
    )


def windows_from_layer_types(hf: dict[str, Any]) -> tuple[int, ...]:
    """Per-layer windows from HF `layer_types` ("sliding_attention" gets `sliding_window`).

    Raises:
        ValueError: An entry that is not one of `LAYER_TYPES`.
    """
    for t in hf["layer_types"]:
        if t not in LAYER_TYPES:
            raise ValueError(f"unsupported layer_types entry {t!r}; supported: "
                             f"{', '.join(LAYER_TYPES)}")
    window = int(hf.get("sliding_window") or 0)
    return tuple(window if t == "sliding_attention" else 0 for t in hf["layer_types"])

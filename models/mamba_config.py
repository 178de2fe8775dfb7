"""The config fields of IBM Granite 4.0 hybrids (`GraniteMoeHybridForCausalLM`): which layers
are Mamba-2 (`models.mamba2`), their shapes, and Granite's multipliers."""

from __future__ import annotations

import math
from typing import Any

from models.hybrid_config import check_layer_types

# transformers' `GraniteMoeHybridConfig` defaults for the fields a checkpoint may omit.
MAMBA_DEFAULTS = dict(mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256,
                      mamba_d_conv=4, mamba_expand=2, shared_intermediate_size=1024,
                      num_local_experts=8, num_experts_per_tok=2)
# Each `layer_types` entry's kind: transformers 5 names, and the names Granite's published
# configs use (transformers remaps them, `configuration_utils._LEGACY_LAYER_TYPE_REMAP`).
GRANITE_LAYER_TYPES = {"mamba": "linear_attention", "linear_attention": "linear_attention",
                       "attention": "full_attention", "full_attention": "full_attention"}
# `position_embedding_type`: transformers rotates only for "rope" (Granite 4.0-H: "nope").
POSITION_EMBEDDINGS = {"rope": True, "nope": False, None: False}


def _int(hf: dict[str, Any], name: str) -> int:
    value = hf.get(name, MAMBA_DEFAULTS.get(name))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} for {hf['architectures'][0]} must be a positive "
                         "integer")
    return value


def _float(value) -> float:
    """A float of the config; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def granite_layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's kind ("linear_attention" or "full_attention") from `layer_types` (or
    its older name `layers_block_type`); transformers' default: every layer Mamba-2.

    Raises:
        ValueError: An unknown entry, or another count than `num_hidden_layers`.
    """
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n
    return [GRANITE_LAYER_TYPES[t] for t in check_layer_types(hf, types, GRANITE_LAYER_TYPES)]


def mamba_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The `ArchConfig` fields of Granite's Mamba-2 layers (`models.mamba2` says how the
    `linear_*` fields read for them).

    Raises:
        ValueError: A bad `layer_types`, a non-positive size, heads that do not split
            `mamba_expand * hidden_size` (`mamba_d_head`), groups that do not divide the
            heads, or a `time_step_limit` that clamps (transformers clamps the chunked
            scan's steps but not its single-token ones, so it has no one answer).
    """
    types = granite_layer_types(hf)
    heads, groups = _int(hf, "mamba_n_heads"), _int(hf, "mamba_n_groups")
    inner = _int(hf, "mamba_expand") * int(hf["hidden_size"])
    head_dim = hf.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = inner // heads
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim * heads != inner:
        raise ValueError(f"mamba_d_head={head_dim!r} x mamba_n_heads={heads} must be "
                         f"mamba_expand * hidden_size = {inner}")
    if heads % groups:
        raise ValueError(f"mamba_n_heads ({heads}) must be a multiple of mamba_n_groups "
                         f"({groups})")
    limit = [_float(v) for v in hf.get("time_step_limit") or (0.0, math.inf)]
    if limit[0] > 0 or not math.isinf(limit[1]):
        raise ValueError(f"time_step_limit={limit} is not served: only (0, inf)")
    return dict(linear_kind="mamba2",
                linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                linear_num_key_heads=groups, linear_num_value_heads=heads,
                linear_key_head_dim=_int(hf, "mamba_d_state"), linear_value_head_dim=head_dim,
                linear_conv_kernel_dim=_int(hf, "mamba_d_conv"),
                linear_conv_bias=bool(hf.get("mamba_conv_bias", True)),
                linear_proj_bias=bool(hf.get("mamba_proj_bias", False)))


def expert_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The MLP fields of Granite 4.0: with `num_local_experts` > 0 (4.0-H Tiny, Small) routed
    experts of `intermediate_size` (`block_sparse_moe`: the top-k router logits, then a
    softmax over those k) plus the shared MLP as an ungated shared expert of
    `shared_intermediate_size`; with none (4.0-H Micro), the shared MLP as every layer's
    dense MLP.

    Raises:
        ValueError: A negative or non-integer `num_local_experts`, a non-positive
            `shared_intermediate_size`, and with experts a non-positive
            `intermediate_size` or `num_experts_per_tok` (above the experts:
            `ArchConfig`'s check names it).
    """
    shared = _int(hf, "shared_intermediate_size")
    experts = hf.get("num_local_experts", MAMBA_DEFAULTS["num_local_experts"]) or 0
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise ValueError(f"num_local_experts={experts!r} for {hf['architectures'][0]} must be "
                         "an integer >= 0 (0: the shared MLP alone)")
    if not experts:
        return dict(intermediate_size=shared)
    # NOTE: `intermediate_size` is the routed experts' width here; no layer is dense, so the
    # decoder's dense width is left the shared MLP's (unused).
    return dict(intermediate_size=shared, num_experts=experts,
                num_experts_per_tok=_int(hf, "num_experts_per_tok"),
                moe_intermediate_size=_int(hf, "intermediate_size"),
                router_order="topk_softmax", shared_expert_intermediate_size=shared,
                shared_expert_gated=False)


def granite_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Every `ArchConfig` field Granite 4.0 sets apart from `common_fields`: the Mamba-2
    layers, the routed experts and shared MLP (`expert_fields`), attention biases, rotary
    or none, and the embedding, attention, residual and logits multipliers.

    Raises:
        ValueError: The Mamba fields' errors (`mamba_fields`), the MLP fields' errors
            (`expert_fields`), an unknown `position_embedding_type`, or a `hidden_act`
            other than silu (the conv's activation too).
    """
    arch = hf["architectures"][0]
    kind = hf.get("position_embedding_type")
    if kind not in POSITION_EMBEDDINGS:
        raise ValueError(f"unsupported position_embedding_type {kind!r} for {arch}; "
                         "supported: rope, nope (or none)")
    if (hf.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} for {arch}: its Mamba-2 conv and "
                         "MLP are served with silu only")
    bias = bool(hf.get("attention_bias", False))
    return dict(mamba_fields(hf), **expert_fields(hf), qkv_bias=bias, o_bias=bias,
                use_rope=POSITION_EMBEDDINGS[kind],
                embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                logits_scaling=float(hf.get("logits_scaling", 1.0)),
                attention_multiplier=float(hf.get("attention_multiplier", 1.0)))

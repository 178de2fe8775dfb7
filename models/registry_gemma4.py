"""The Gemma 4 text family: `Gemma4ForCausalLM` and the language model of a
`Gemma4ForConditionalGeneration` checkpoint, mapped onto `ArchConfig` as transformers'
`Gemma4TextConfig` reads its fields (its defaults filling what a config leaves out)."""

from __future__ import annotations

import logging
from typing import Any

from models.family_base import ModelFamily, text_config
from models.gemma4_moe import moe_fields
from models.hf_fields import windows_from_layer_types
from models.rope import parse_rope

logger = logging.getLogger(__name__)

# `Gemma4TextConfig`'s defaults for the fields the family reads.
DEFAULTS = dict(hidden_activation="gelu_pytorch_tanh", head_dim=256, num_key_value_heads=4,
                rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512,
                vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256,
                max_position_embeddings=131_072)
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
GLOBAL_HEAD_DIM = 512  # `Gemma4TextConfig`'s full-attention head width when not given


def layer_types(hf: dict[str, Any]) -> list[str]:
    """`layer_types`, or transformers' default (every 6th layer full); the last layer is
    full attention whatever the config says (transformers forces it, with a warning)."""
    n = int(hf["num_hidden_layers"])
    types = list(hf.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    types[-1] = "full_attention"
    return types


def head_shapes(hf: dict[str, Any], types: list[str]) -> dict[str, int]:
    """The `ArchConfig` head fields: the sliding layers' shape as `head_dim` and
    `num_kv_heads`, the full-attention layers' as `global_head_dim` and `global_kv_heads`
    when it differs (`models.gemma4_heads`). As transformers: `global_head_dim` (default
    512) and, with `attention_k_eq_v`, `num_global_key_value_heads` set the full layers'
    shape, unless a saved config's `per_layer_config` gives every layer's."""
    base = (int(hf["head_dim"]), int(hf["num_key_value_heads"]))
    per_layer = hf.get("per_layer_config")
    if per_layer is not None:  # transformers then takes these entries and no defaults
        shapes = [base] * len(types)
        for key, entry in per_layer.items():
            entry = entry or {}
            shapes[int(key)] = (int(entry.get("head_dim", base[0])),
                                int(entry.get("num_key_value_heads", base[1])))
    else:
        global_kv = hf.get("num_global_key_value_heads")
        full = (int(hf.get("global_head_dim") or GLOBAL_HEAD_DIM),
                int(global_kv) if hf.get("attention_k_eq_v") and global_kv else base[1])
        shapes = [full if t == "full_attention" else base for t in types]
    by_kind = {}
    for i, (kind, shape) in enumerate(zip(types, shapes, strict=True)):
        if by_kind.setdefault(kind, shape) != shape:
            raise ValueError(f"per_layer_config: layer {i} ({kind}) has head_dim, "
                             f"num_key_value_heads {shape}, another {kind} layer "
                             f"{by_kind[kind]}: one shape per kind of layer is served")
    local = by_kind.get("sliding_attention", by_kind.get("full_attention"))
    full = by_kind.get("full_attention", local)
    fields = dict(head_dim=local[0], num_kv_heads=local[1])
    if full != local:
        fields.update(global_head_dim=full[0], global_kv_heads=full[1])
    return fields


class Gemma4(ModelFamily):
    """Gemma 4 (text): Gemma 3's sandwich norms and embedding scale with plain-weight
    RMSNorms, q/k norms and a scale-free value norm, an attention scale of 1, proportional
    rotary on the full layers, per-layer input embeddings, KV shared by the last
    `num_kv_shared_layers` layers, `attention_k_eq_v`, a learned scalar per layer and the
    double-wide MLP (`models.gemma4`), full-attention layers of their own head shape
    (`models.gemma4_heads`), and with `enable_moe_block` routed experts beside every layer's
    dense MLP (`models.gemma4_moe`)."""

    architectures = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")

    @classmethod
    def arch_config(cls, hf):
        hf = text_config(hf, "vision and audio towers are")
        return super().arch_config({**DEFAULTS, **{k: v for k, v in hf.items()
                                                  if v is not None}})

    @classmethod
    def extra_fields(cls, hf):
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"unsupported use_bidirectional_attention="
                             f"{hf['use_bidirectional_attention']!r}: only causal attention "
                             "is served")
        types = layer_types(hf)
        if "sliding_attention" in types and not int(hf.get("sliding_window") or 0) > 0:
            raise ValueError(f"sliding_window={hf.get('sliding_window')} must be positive for "
                             "sliding_attention layers")
        rp = {**DEFAULT_ROPE, **(hf.get("rope_parameters") or {})}
        max_len = {"max_position_embeddings": hf.get("max_position_embeddings")}
        theta, scaling = parse_rope({"rope_parameters": rp.get("full_attention") or {}, **max_len})
        local_theta, local_scaling = parse_rope(
            {"rope_parameters": rp.get("sliding_attention") or {}, **max_len})
        shared = int(hf.get("num_kv_shared_layers") or 0)
        double = bool(hf.get("use_double_wide_mlp")) and shared > 0
        ple = int(hf.get("hidden_size_per_layer_input") or 0)
        bias = bool(hf.get("attention_bias", False))
        cap = hf.get("final_logit_softcapping")
        return dict(qkv_bias=bias, o_bias=bias, embed_scale=True, sandwich_norms=True,
                    qk_norm=True, v_norm=True, layer_scalar=True, attention_multiplier=1.0,
                    final_logit_softcap=None if cap is None else float(cap),
                    layer_windows=windows_from_layer_types({**hf, "layer_types": types}),
                    rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
                    local_rope_scaling=local_scaling,
                    per_layer_input_size=ple,
                    per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input") or 0)
                    if ple else 0,
                    kv_shared_layers=shared,
                    attention_k_eq_v=bool(hf.get("attention_k_eq_v")),
                    double_wide_mlp=double, **head_shapes(hf, types),
                    intermediate_size=int(hf["intermediate_size"]) * (2 if double else 1),
                    **moe_fields(hf))

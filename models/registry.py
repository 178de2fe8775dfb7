"""Model families and the registry from HF `architectures` names to them.

Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2 and Gemma 3, the mixtures of experts
Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, the linear-attention hybrids Qwen3-Next, Qwen3.5
and Granite 4.0 (Mamba-2), DeepSeek-V2/V3 (latent attention), gpt-oss and Llama 4
(`models.registry_llama4`) share one Flax decoder
(`models.decoder.Decoder`); a family only decides how its HF config maps onto `ArchConfig`.
"""

from __future__ import annotations

import logging
from typing import Any

from models.config import ArchConfig
from models.family_base import ModelFamily, text_config
from models.hf_fields import partial_rotary_factor, windows_from_layer_types
from models.moe_config import sparse_fields
from models.mrope import mrope_section_of
from models.registry_gemma4 import Gemma4
from models.registry_llama4 import Llama4
from models.registry_mixers import (
    DeepseekV2,
    DeepseekV3,
    GraniteMoeHybrid,
    Qwen3_5,
    Qwen3_5Moe,
    Qwen3Next,
)
from models.rope import parse_rope

logger = logging.getLogger(__name__)


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


class Phi3(ModelFamily):
    """Phi-3, Phi-3.5 and Phi-4-mini (dense): fused `qkv_proj` and `gate_up_proj` weights
    (split at load: `models.loaders.hf_names.SplitFused`), LongRoPE, a partial rotary
    (`partial_rotary_factor`), and `sliding_window` on every layer."""

    architectures = ("Phi3ForCausalLM",)
    partial_rotary = True

    @classmethod
    def arch_config(cls, hf):
        # As transformers' Phi3Config: the old rope type names "su" and "yarn" mean longrope,
        # `original_max_position_embeddings` defaults to 4096 and, set, is the rope's.
        hf = {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096, **hf}
        for key in ("rope_scaling", "rope_parameters"):
            rope = dict(hf.get(key) or {})
            kind = rope.get("rope_type", rope.get("type"))
            if kind in ("su", "yarn"):
                rope.pop("type", None)
                hf[key] = {**rope, "rope_type": "longrope"}
        kind = parse_rope(hf)[1].rope_type
        if kind not in ("default", "longrope"):
            raise ValueError(f"unsupported rope type {kind!r} for {hf['architectures'][0]}: "
                             "its transformers class takes default or longrope only")
        return super().arch_config(hf)

    @classmethod
    def extra_fields(cls, hf):
        window = int(hf.get("sliding_window") or 0)
        return dict(layer_windows=(window,) * int(hf["num_hidden_layers"]),
                    partial_rotary_factor=partial_rotary_factor(hf))


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


class Qwen2_5_VL(Qwen2):
    """Qwen2.5-VL's language model (a Qwen2 decoder) with its multimodal rotary
    (`mrope_section`, `models.mrope`): its images are served by `models.vision`."""

    architectures = ("Qwen2_5_VLForConditionalGeneration",)

    @classmethod
    def arch_config(cls, hf):
        text = hf.get("text_config") or hf
        return super().arch_config({**text, "architectures": hf["architectures"]})

    @classmethod
    def extra_fields(cls, hf):
        return dict(super().extra_fields(hf), mrope_section=mrope_section_of(hf))


class Qwen3(Qwen2):
    """Qwen3: per-head RMSNorm on q and k before rotary, optional attention bias."""

    # `Qwen3Model`: a bare decoder (Qwen3-Embedding-style checkpoints, served by the pooling
    # runner; a missing LM head is tied to the embeddings by `read_arch_config`).
    architectures = ("Qwen3ForCausalLM", "Qwen3Model")

    @classmethod
    def extra_fields(cls, hf):
        bias = bool(hf.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, layer_windows=cls._windows(hf))


class Gemma2(ModelFamily):
    """Gemma 2: GeGLU (tanh GELU), `(1 + weight)` RMSNorms around both blocks, embeddings
    scaled by `sqrt(hidden_size)`, `query_pre_attn_scalar`, attention and final logit
    soft-capping, sliding and global layers alternating."""

    architectures = ("Gemma2ForCausalLM",)
    default_pattern = 2  # without `layer_types`: every `pattern`-th layer is global

    @classmethod
    def _windows(cls, hf):
        if hf.get("layer_types") is None:
            pattern = int(hf.get("sliding_window_pattern") or cls.default_pattern)
            if pattern < 1:
                raise ValueError(f"sliding_window_pattern must be >= 1, got {pattern}")
            hf = {**hf, "layer_types": [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(int(hf["num_hidden_layers"]))]}
        if "sliding_attention" in hf["layer_types"] and not hf.get("sliding_window"):
            raise ValueError(f"{hf['architectures'][0]} config has sliding_attention layers "
                             "but no sliding_window")
        return windows_from_layer_types(hf)

    @classmethod
    def extra_fields(cls, hf):
        # NOTE: transformers' Gemma reads `hidden_activation` alone (`hidden_act` is
        # ignored), so `common_fields` parsed it when present; absent, it is an error.
        if not hf.get("hidden_activation"):
            raise ValueError(f"{hf['architectures'][0]} config lacks hidden_activation "
                             "(the MLP's activation); it is required")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("unsupported use_bidirectional_attention=True: only causal "
                             "attention is served")
        if hf.get("query_pre_attn_scalar") is None:
            raise ValueError(f"{hf['architectures'][0]} config lacks query_pre_attn_scalar "
                             "(the attention scale); it is required")
        bias = bool(hf.get("attention_bias", False))
        cap = lambda name: None if hf.get(name) is None else float(hf[name])
        return dict(qkv_bias=bias, o_bias=bias, norm_offset=1.0, embed_scale=True,
                    sandwich_norms=True,
                    query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                    attn_logit_softcap=cap("attn_logit_softcapping"),
                    final_logit_softcap=cap("final_logit_softcapping"),
                    layer_windows=cls._windows(hf))


class Gemma3(Gemma2):
    """Gemma 3 (text): Gemma 2's numerics (without the attention soft cap, which a config
    may not set) plus q/k norms, and two rotary bases: global
    layers `rope_parameters["full_attention"]` (with its scaling), sliding ones
    `["sliding_attention"]` (older configs: `rope_theta`, `rope_scaling`,
    `rope_local_base_freq`). The language model of a `Gemma3ForConditionalGeneration`
    checkpoint loads the same way (its `text_config`; the vision tower is ignored)."""

    architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    default_pattern = 6

    @classmethod
    def arch_config(cls, hf):
        if "text_config" in hf:  # a ForConditionalGeneration checkpoint
            hf = text_config(hf)
            if hf.get("final_logit_softcapping") is not None:
                # NOTE: transformers' ForConditionalGeneration never applies it (its
                # ForCausalLM does); public multimodal Gemma 3 configs leave it null.
                raise ValueError(
                    f"unsupported text_config.final_logit_softcapping="
                    f"{hf['final_logit_softcapping']} for {hf['architectures'][0]}: it "
                    "defines no final soft cap (null in its configs)")
        return super().arch_config(hf)

    @classmethod
    def extra_fields(cls, hf):
        if hf.get("attn_logit_softcapping") is not None:
            # NOTE: transformers' Gemma 3 reads the field but never applies it, and public
            # Gemma 3 configs leave it null: serving either way would disagree with someone.
            raise ValueError(f"unsupported attn_logit_softcapping="
                             f"{hf['attn_logit_softcapping']} for {hf['architectures'][0]}: "
                             "Gemma 3 defines no attention soft cap (null in its configs)")
        rp = hf.get("rope_parameters") or {}
        if "full_attention" in rp or "sliding_attention" in rp:
            max_len = {"max_position_embeddings": hf.get("max_position_embeddings")}
            theta, scaling = parse_rope({"rope_parameters": rp.get("full_attention") or {},
                                         "rope_theta": 1_000_000.0, **max_len})
            local_theta, local_scaling = parse_rope(
                {"rope_parameters": rp.get("sliding_attention") or {}, **max_len})
        else:
            theta, scaling = parse_rope({"rope_theta": 1_000_000.0, **hf})
            local_theta = float(hf.get("rope_local_base_freq") or 10_000.0)
            local_scaling = parse_rope({})[1]
        return dict(super().extra_fields(hf), qk_norm=True, rope_theta=theta,
                    rope_scaling=scaling, local_rope_theta=local_theta,
                    local_rope_scaling=local_scaling)


class Mixtral(Mistral):
    """Mixtral: Mistral's attention (the window on every layer) with a sparse MLP of
    `num_local_experts` experts of `intermediate_size`, routed by top-k logits then a
    softmax over those k (`block_sparse_moe.experts.{e}.w1/w2/w3` in checkpoints)."""

    architectures = ("MixtralForCausalLM",)

    @classmethod
    def extra_fields(cls, hf):
        return dict(super().extra_fields(hf), router_order="topk_softmax",
                    **sparse_fields(hf, "num_local_experts", "intermediate_size"))


class Qwen2Moe(Qwen2):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (`qkv_bias` as the
    config says), routed experts of `moe_intermediate_size` (softmax then top-k,
    `norm_topk_prob`), and a shared expert gated by a sigmoid; the layers
    `mlp_only_layers` / `decoder_sparse_step` name have a dense MLP instead."""

    architectures = ("Qwen2MoeForCausalLM",)

    @classmethod
    def extra_fields(cls, hf):
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        return dict(super().extra_fields(hf), qkv_bias=bool(hf.get("qkv_bias", True)),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=shared,
                    **sparse_fields(hf, "num_experts", "moe_intermediate_size", mixed=True))


class Qwen3Moe(Qwen3):
    """Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k norms) with
    routed experts of `moe_intermediate_size` (softmax then top-k, `norm_topk_prob`); the
    layers `mlp_only_layers` / `decoder_sparse_step` name have a dense MLP instead."""

    architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def _windows(cls, hf):
        # NOTE: transformers' Qwen3-MoE puts the window on every layer when
        # use_sliding_window is set (it reads no max_window_layers nor layer_types).
        window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
        return (window,) * int(hf["num_hidden_layers"])

    @classmethod
    def extra_fields(cls, hf):
        return dict(super().extra_fields(hf),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    **sparse_fields(hf, "num_experts", "moe_intermediate_size", mixed=True))


class Olmoe(ModelFamily):
    """OLMoE: q/k RMSNorms over the whole q and k projections (not per head), routed
    experts of `intermediate_size` (softmax then top-k, `norm_topk_prob`)."""

    architectures = ("OlmoeForCausalLM",)

    @classmethod
    def extra_fields(cls, hf):
        if hf.get("clip_qkv") is not None:
            raise ValueError(f"unsupported clip_qkv={hf['clip_qkv']} for "
                             f"{hf['architectures'][0]}: q/k/v clipping is not served")
        bias = bool(hf.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_full=True,
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    **sparse_fields(hf, "num_experts", "intermediate_size"))


class GptOss(ModelFamily):
    """gpt-oss (20B, 120B): attention with biases and learned sinks, sliding and full
    layers alternating (`layer_types`, sliding first by default), YaRN, and routed experts
    in every layer with biases (the router's too), routed by top-k logits then a softmax
    over those k, through gpt-oss's clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`). Its
    experts are stacked per layer in the checkpoint (`models.loaders.gpt_oss_names`), in
    MXFP4 in the published ones (`models.loaders.quant_formats.gpt_oss`)."""

    architectures = ("GptOssForCausalLM",)
    # transformers' `GptOssConfig` defaults where a config leaves a field out.
    DEFAULTS = {"rms_norm_eps": 1e-5, "attention_bias": True, "sliding_window": 128,
                "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "rope_theta": 150000.0,
                "max_position_embeddings": 131072, "head_dim": 64}
    DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "truncate": False, "original_max_position_embeddings": 4096}

    @classmethod
    def arch_config(cls, hf):
        hf = {**cls.DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
        if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
            hf["rope_parameters"] = {**cls.DEFAULT_ROPE, "rope_theta": hf["rope_theta"]}
        if not hf.get("layer_types"):
            hf["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                 for i in range(int(hf["num_hidden_layers"]))]
        return super().arch_config(hf)

    @classmethod
    def extra_fields(cls, hf):
        if "sliding_attention" in hf["layer_types"] and not int(hf["sliding_window"]) > 0:
            raise ValueError(f"sliding_window={hf['sliding_window']} for "
                             f"{hf['architectures'][0]}: its sliding_attention layers need a "
                             "positive window")
        bias = bool(hf["attention_bias"])
        return dict(qkv_bias=bias, o_bias=bias, attention_sinks=True, moe_bias=True,
                    layer_windows=windows_from_layer_types(hf), router_order="topk_softmax",
                    swiglu_limit=float(hf["swiglu_limit"]),
                    swiglu_alpha=float(hf["swiglu_alpha"]),
                    **sparse_fields(hf, "num_local_experts", "intermediate_size"))


FAMILIES: dict[str, type[ModelFamily]] = {
    name: fam for fam in (Llama, Mistral, Phi3, Qwen2, Qwen2_5_VL, Qwen3, Gemma2, Gemma3, Mixtral,
                          Qwen2Moe, Qwen3Moe, Olmoe, Qwen3_5, Qwen3_5Moe, Qwen3Next,
                          GraniteMoeHybrid, DeepseekV2, DeepseekV3, GptOss, Gemma4,
                          Llama4)
    for name in fam.architectures
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

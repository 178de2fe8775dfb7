"""The families whose token mixers are not only GQA attention: the linear-attention hybrids
Qwen3.5, Qwen3.5-MoE, Qwen3-Next (Gated DeltaNet) and Granite 4.0 (Mamba-2), and DeepSeek-V2/V3
(multi-head latent attention). `models.registry` maps their architectures."""

from __future__ import annotations

from models.deepseek_config import deepseek_fields
from models.family_base import ModelFamily
from models.hf_fields import partial_rotary_factor
from models.hybrid_config import linear_attention_fields, with_hybrid_defaults
from models.mamba_config import granite_fields
from models.moe_config import sparse_fields


class Qwen3_5(ModelFamily):
    """Qwen3.5 (text, dense): Gated DeltaNet layers (`in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a`, a causal conv1d, a gated RMSNorm) and every
    `full_attention_interval`-th layer gated full attention (q/k norms, a quarter of each
    head rotated by default), zero-centred RMSNorms (`models.hybrid_config`)."""

    architectures = ("Qwen3_5ForCausalLM",)
    partial_rotary = True

    @classmethod
    def arch_config(cls, hf):
        return super().arch_config(with_hybrid_defaults(hf))

    @classmethod
    def extra_fields(cls, hf):
        return dict(linear_attention_fields(hf),
                    partial_rotary_factor=partial_rotary_factor(hf))


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5-MoE (text): Qwen3.5's layers with a mixture of experts in every layer
    (softmax then top-k, the top-k always renormalized) and a sigmoid-gated shared
    expert."""

    architectures = ("Qwen3_5MoeForCausalLM",)

    @classmethod
    def arch_config(cls, hf):
        # NOTE: its config has no intermediate_size (no layer is dense); the field is unused.
        return super().arch_config({"intermediate_size": hf.get("moe_intermediate_size"),
                                    **hf})

    @classmethod
    def extra_fields(cls, hf):
        return dict(super().extra_fields(hf), norm_topk_prob=True,
                    shared_expert_intermediate_size=int(
                        hf.get("shared_expert_intermediate_size") or 0),
                    **sparse_fields(hf, "num_experts", "moe_intermediate_size"))


class Qwen3Next(Qwen3_5):
    """Qwen3-Next: Qwen3.5's layers with the linear projections fused per key head
    (`in_proj_qkvz`, `in_proj_ba`: cut apart at load, `models.loaders.hf_names`), and
    Qwen2-MoE's mixture of experts (shared expert, `norm_topk_prob`, dense layers by
    `mlp_only_layers` / `decoder_sparse_step`); no experts: every MLP dense."""

    architectures = ("Qwen3NextForCausalLM",)

    @classmethod
    def extra_fields(cls, hf):
        fields = super().extra_fields(hf)
        if not int(hf.get("num_experts") or 0):
            return fields
        return dict(fields, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                    shared_expert_intermediate_size=int(
                        hf.get("shared_expert_intermediate_size") or 0),
                    **sparse_fields(hf, "num_experts", "moe_intermediate_size", mixed=True))


class GraniteMoeHybrid(ModelFamily):
    """IBM Granite 4.0 (hybrid and dense): Mamba-2 layers (`models.mamba2`) beside plain
    attention with rotary or none, Granite's multipliers, and the shared MLP
    (`shared_mlp.input_linear` fused gate and up) as every layer's dense MLP
    (`models.mamba_config`; routed experts refused)."""

    architectures = ("GraniteMoeHybridForCausalLM",)

    @classmethod
    def extra_fields(cls, hf):
        return granite_fields(hf)


class DeepseekV3(ModelFamily):
    """DeepSeek-V3/R1 and Kimi K2: multi-head latent attention (`models.mla`: one latent per
    token in the pool, the rotary on interleaved pairs), sigmoid routing with a selection
    bias over expert groups, shared experts, dense first layers (`models.deepseek_config`)."""

    architectures = ("DeepseekV3ForCausalLM",)
    version = "v3"

    @classmethod
    def extra_fields(cls, hf):
        return deepseek_fields(hf, cls.version)


class DeepseekV2(DeepseekV3):
    """DeepSeek-V2 (and V2-Lite): V3's attention with softmax routing (`greedy` or
    `group_limited_greedy`), no renormalization."""

    architectures = ("DeepseekV2ForCausalLM",)
    version = "v2"

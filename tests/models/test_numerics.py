"""Model numerics against transformers (torch, float32, eager attention) as the oracle.

Tiny random models of every family are saved as Hugging Face directories, loaded with
`load_model`, and their teacher-forced logits compared with transformers', run whole and
in chunks through a shuffled paged KV cache. SmolLM2 is compared from the same GGUF.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from models.linear import ServingChoice
from models.loaders import load_model
from models.model import Model
from models.rope import RopeScaling
from tests.kernels.cases import slow_except
from tests.models.helpers import forward_logits, forward_routing, hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ_LEN = 24
PAGE_SIZE = 4
F32_ATOL = 1e-4

# How each teacher-forced run splits the prompt into consecutive steps.
CHUNKINGS = {
    "whole": None,
    "chunked": (7, 9, 8),  # chunks straddle page boundaries
    "prefill_decode": (17, 1, 1, 1, 1, 1, 1, 1),  # a prefill then single-token steps
}

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.15, rms_norm_eps=1e-6)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# Phi-3: half of each 16-wide head rotated, LongRoPE past an original context of 16 (the
# 24-token prompt: transformers takes the long factors, as our tables by default).
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
             "short_factor": [1.0, 1.3, 2.1, 3.5], "long_factor": [1.5, 4.0, 9.0, 20.0]}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0}


# Gated DeltaNet shapes (2 key heads, each serving 2 of the 4 value heads). NOTE: with the
# other cases' initializer_range (0.15) these models are chaotic: weights moved by one float32
# ulp move transformers' own logits by up to 1e-3. At 0.05 that stays below 1e-5.
HYBRID = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              initializer_range=0.05, num_hidden_layers=3)

# Granite 4.0's Mamba-2 layers: 8 heads of 16 channels (the trap: heads x d_head must be
# mamba_expand x hidden_size = 128), B and C in 2 groups of state size 8, no routed experts
# (granite_moe_nope adds them);
# its multipliers apart from 1 (logits_scaling below 1 keeps the logits' spread above 0.5).
GRANITE = dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
               shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
               mamba_d_state=8, mamba_d_conv=4, num_local_experts=0, embedding_multiplier=3.0,
               residual_multiplier=0.5, logits_scaling=0.25, attention_multiplier=0.2,
               initializer_range=0.05)


# DeepSeek's multi-head latent attention (a latent of 16 + 8 per token, a query low rank or
# none, value heads apart from the key heads) and routing: 8 experts in 2 groups, one group
# per token, shared experts, the first layer dense.
DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
                num_hidden_layers=3)
# YaRN with `mscale_all_dim`: DeepSeek scales the softmax by mscale(factor) squared too.
DEEPSEEK_YARN = dict(YARN_ROPE, mscale=1.0, mscale_all_dim=1.0)
# Gemma 4: sliding (5) and full layers, per-layer inputs of 8 (a table of the whole
# vocabulary, as the real models'), the last two layers reading layers 0 and 1's KV (twice as
# wide MLPs), keys as values on the full layers, proportional rotary there (2 of 8 frequencies).
GEMMA4 = dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=5,
              layer_types=["sliding_attention", "full_attention"] * 2,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=160,
              num_kv_shared_layers=2, attention_k_eq_v=True, use_double_wide_mlp=True,
              num_global_key_value_heads=1)
# Gemma 4's MoE block (as gemma-4-26B-A4B: no per-layer inputs nor shared KV): a dense MLP
# of 96 and 4 experts of 32 (top 2) side by side in both layers, keys as values on the full
# one, whose heads are twice as wide with one KV head (as 26B-A4B's); its router's scales
# drawn apart from their ones (`_perturb`).
GEMMA4_MOE = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention"],
                  hidden_size_per_layer_input=0, attention_k_eq_v=True, enable_moe_block=True,
                  num_experts=4, top_k_experts=2, moe_intermediate_size=32)
# gpt-oss: 4 experts of 32, top 2, sliding (5) then full layers, YaRN without truncation, and a
# SwiGLU clamp of 1 (the tiny experts' outputs pass it; gpt-oss's 7 would never bind here).
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
               sliding_window=5, swiglu_limit=1.0,
               rope_parameters=dict(YARN_ROPE, truncate=False))

# Llama 4: chunks of 8 (three in the 24-token prompt) on the rotary layers 0 and 2, layer 1
# NoPE (full attention) with a temperature that grows from position 3 (floor_scale 4), q/k
# norms, llama3 rotary on interleaved pairs; layer 1 MoE (4 experts of 32, top 1, sigmoid
# weights on the expert input, a shared expert of 32), layers 0 and 2 dense MLPs of 96.
LLAMA4 = dict(num_hidden_layers=3, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
              no_rope_layers=[1, 0, 1], attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
              rope_parameters=LLAMA3_ROPE)


@dataclasses.dataclass(frozen=True)
class Case:
    """One tiny model: its transformers classes, config overrides, and what must matter.

    Attributes:
        name: Test id.
        config_cls: transformers config class name.
        model_cls: transformers model class name.
        overrides: Config fields on top of `TINY`.
        expect: `ArchConfig` fields the loader must have parsed.
        ablate: `ArchConfig` fields which, when reset, must break agreement with the
            oracle (proves the feature is exercised at this prompt's positions).
    """

    name: str
    config_cls: str
    model_cls: str
    overrides: dict
    expect: dict
    ablate: dict | None = None


CASES = [
    Case("llama_gqa_llama3rope", "LlamaConfig", "LlamaForCausalLM",
         dict(rope_parameters=LLAMA3_ROPE),
         dict(num_kv_heads=2, tie_word_embeddings=False, qkv_bias=False),
         ablate=dict(rope_scaling=RopeScaling())),
    Case("llama_yarn", "LlamaConfig", "LlamaForCausalLM",
         dict(rope_parameters=YARN_ROPE),
         dict(rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16,
                                       beta_fast=8.0)),
         ablate=dict(rope_scaling=RopeScaling())),
    Case("phi3_longrope_partial", "Phi3Config", "Phi3ForCausalLM",
         dict(original_max_position_embeddings=16, partial_rotary_factor=0.5, sliding_window=7,
              rope_parameters=PHI3_ROPE, pad_token_id=0, bos_token_id=1, eos_token_id=2),
         dict(rotary_dim=8, partial_rotary_factor=0.5, layer_windows=(7, 7), qkv_bias=False,
              rms_norm_eps=1e-6),
         ablate=dict(rope_scaling=RopeScaling(), layer_windows=(0, 0))),
    Case("llama_tied", "LlamaConfig", "LlamaForCausalLM",
         dict(tie_word_embeddings=True, num_hidden_layers=3),
         dict(tie_word_embeddings=True)),
    Case("llama_bias", "LlamaConfig", "LlamaForCausalLM",
         dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1),
         dict(qkv_bias=True, o_bias=True, mlp_bias=True, num_kv_heads=1)),
    Case("qwen2_bias", "Qwen2Config", "Qwen2ForCausalLM",
         dict(rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
         dict(qkv_bias=True, o_bias=False, layer_windows=(0, 0))),
    Case("qwen2_window_layers", "Qwen2Config", "Qwen2ForCausalLM",
         dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
              max_window_layers=1),
         dict(layer_windows=(0, 5, 5), qkv_bias=True, o_bias=False),
         ablate=dict(layer_windows=(0, 0, 0))),
    Case("qwen2_layer_types_linear_rope", "Qwen2Config", "Qwen2ForCausalLM",
         dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=6,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}),
         dict(layer_windows=(6, 0, 6), rope_scaling=RopeScaling("linear", factor=4.0)),
         ablate=dict(layer_windows=(0, 0, 0))),
    Case("qwen3_qknorm_headdim", "Qwen3Config", "Qwen3ForCausalLM",
         dict(head_dim=24),
         dict(head_dim=24, qk_norm=True, qkv_bias=False)),
    Case("qwen3_bias_sliding", "Qwen3Config", "Qwen3ForCausalLM",
         dict(head_dim=8, attention_bias=True, use_sliding_window=True, sliding_window=4,
              max_window_layers=1),
         dict(head_dim=8, qk_norm=True, qkv_bias=True, o_bias=True, layer_windows=(0, 4)),
         ablate=dict(layer_windows=(0, 0))),
    Case("mistral_sliding", "MistralConfig", "MistralForCausalLM",
         dict(sliding_window=5),
         dict(layer_windows=(5, 5)),
         ablate=dict(layer_windows=(0, 0))),
    # Gemma: soft caps below the uncapped logits' range, query_pre_attn_scalar apart from
    # head_dim, windows shorter than the prompt. (The structural fields, the activation,
    # norms and embedding scale, need no ablation: any prompt exercises them.)
    Case("gemma2_softcap", "Gemma2Config", "Gemma2ForCausalLM",
         dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=32, sliding_window=6,
              attn_logit_softcapping=2.0, final_logit_softcapping=4.0),
         dict(layer_windows=(6, 0, 6), hidden_act="gelu_pytorch_tanh", norm_offset=1.0,
              embed_scale=True, sandwich_norms=True, tie_word_embeddings=True,
              query_pre_attn_scalar=32.0, attn_logit_softcap=2.0, final_logit_softcap=4.0),
         ablate=dict(layer_windows=(0, 0, 0), attn_logit_softcap=None,
                     final_logit_softcap=None, query_pre_attn_scalar=None)),
    Case("gemma2_global_first", "Gemma2Config", "Gemma2ForCausalLM",
         dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
              layer_types=["full_attention", "sliding_attention"],
              attn_logit_softcapping=3.0, final_logit_softcapping=None),
         dict(layer_windows=(0, 5), attn_logit_softcap=3.0, final_logit_softcap=None),
         ablate=dict(layer_windows=(0, 0), attn_logit_softcap=None)),
    Case("gemma3_two_ropes", "Gemma3TextConfig", "Gemma3ForCausalLM",
         dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
              sliding_window_pattern=3,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                  "rope_theta": 10000.0},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 100.0}}),
         dict(layer_windows=(6, 6, 0), qk_norm=True, norm_offset=1.0, rope_theta=10000.0,
              rope_scaling=RopeScaling("linear", factor=8.0), local_rope_theta=100.0,
              attn_logit_softcap=None, final_logit_softcap=None),
         ablate=dict(layer_windows=(0, 0, 0), local_rope_theta=None,
                     rope_scaling=RopeScaling(), query_pre_attn_scalar=None)),
    Case("gemma3_pattern2_softcap", "Gemma3TextConfig", "Gemma3ForCausalLM",
         dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
              sliding_window_pattern=2, final_logit_softcapping=4.0),
         dict(layer_windows=(5, 0, 5, 0), local_rope_theta=10000.0, rope_theta=1e6,
              attn_logit_softcap=None, final_logit_softcap=4.0),
         ablate=dict(layer_windows=(0, 0, 0, 0), final_logit_softcap=None)),
    # Mixtures of experts (4-6 experts, top 2, 24 tokens: every expert is routed some and
    # the routers' orders differ). `ablate` proves the router order and norm_topk_prob matter.
    Case("mixtral_moe", "MixtralConfig", "MixtralForCausalLM",
         dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
              sliding_window=None),
         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              router_order="topk_softmax", layer_windows=(0, 0)),
         ablate=dict(router_order="softmax_topk")),
    Case("qwen2_moe_shared", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, norm_topk_prob=False),
         dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              norm_topk_prob=False, router_order="softmax_topk", qkv_bias=True),
         ablate=dict(router_order="topk_softmax")),
    Case("qwen3_moe_norm_topk", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
              norm_topk_prob=True),
         dict(num_experts=6, norm_topk_prob=True, qk_norm=True, qk_norm_full=False),
         ablate=dict(norm_topk_prob=False)),
    Case("olmoe_full_qknorm", "OlmoeConfig", "OlmoeForCausalLM",
         dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32,
              norm_topk_prob=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
         dict(num_experts=4, moe_intermediate_size=32, qk_norm=True, qk_norm_full=True,
              norm_topk_prob=False),
         ablate=dict(router_order="topk_softmax")),
    # Mixtures of experts whose layers mix sparse and dense MLPs (`models.mixed`): the
    # dense layers' MLPs have their own width (intermediate_size 96, experts 32).
    Case("qwen3_moe_mlp_only", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
              norm_topk_prob=True, mlp_only_layers=[1]),
         dict(num_experts=4, dense_layers=(1,), norm_topk_prob=True, qk_norm=True,
              qk_norm_full=False)),
    Case("qwen3_moe_sparse_step", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, head_dim=16, decoder_sparse_step=2),
         dict(dense_layers=(0, 2))),
    Case("qwen2_moe_mixed", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
         dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48,
              norm_topk_prob=False, mlp_only_layers=[2], decoder_sparse_step=1),
         dict(dense_layers=(2,), shared_expert_intermediate_size=48)),
    # Linear-attention hybrids (`models.hybrid`): Gated DeltaNet layers (their state carried
    # in a shuffled slot from chunk to chunk) beside gated full attention, a quarter of each
    # head rotated (transformers' default), zero-centred norms.
    Case("qwen3_5_hybrid", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
         dict(HYBRID, layer_types=["linear_attention", "full_attention", "linear_attention"]),
         dict(linear_layers=(0, 2), attn_output_gate=True, partial_rotary_factor=0.25,
              rotary_dim=4, norm_offset=1.0, qk_norm=True, linear_num_value_heads=4),
         ablate=dict(norm_offset=0.0, partial_rotary_factor=0.5)),
    Case("qwen3_next_moe_fused", "Qwen3NextConfig", "Qwen3NextForCausalLM",
         dict(HYBRID, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48,
              mlp_only_layers=[1]),
         dict(linear_layers=(0, 1, 2), dense_layers=(1,), norm_topk_prob=True,
              shared_expert_intermediate_size=48, attn_output_gate=True),
         ablate=dict(norm_topk_prob=False, partial_rotary_factor=0.5)),
    Case("qwen3_5_moe_hybrid", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
         dict(HYBRID, num_hidden_layers=4, full_attention_interval=2, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48),
         dict(linear_layers=(0, 2), num_experts=4, norm_topk_prob=True,
              shared_expert_intermediate_size=48, dense_layers=()),
         ablate=dict(norm_topk_prob=False)),
    # Granite 4.0 (`models.mamba2`): Mamba-2 layers (conv and SSD state carried in a shuffled
    # slot) beside plain attention, rotary or none, Granite's four multipliers.
    Case("granite_mamba2_rope", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
         dict(GRANITE, position_embedding_type="rope"),
         dict(linear_layers=(0, 2), linear_kind="mamba2", linear_num_value_heads=8,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_key_head_dim=8,
              linear_conv_bias=True, intermediate_size=96, use_rope=True,
              attention_multiplier=0.2),
         ablate=dict(residual_multiplier=1.0, attention_multiplier=None, use_rope=False,
                     embedding_multiplier=1.0)),
    # Granite 4.0-H Tiny's MLP: routed experts (top-k logits, then a softmax over those k;
    # each layer's experts stacked in one `block_sparse_moe` tensor) plus the ungated shared
    # MLP, beside Mamba-2 layers and attention without rotary.
    Case("granite_moe_nope", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
         dict(GRANITE, position_embedding_type="nope", num_local_experts=4,
              num_experts_per_tok=2, intermediate_size=32),
         dict(linear_layers=(0, 2), linear_kind="mamba2", linear_num_value_heads=8,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_key_head_dim=8,
              linear_conv_bias=True, attention_multiplier=0.2, use_rope=False, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=96, shared_expert_gated=False,
              router_order="topk_softmax", dense_layers=()),
         ablate=dict(router_order="softmax_topk")),
    Case("granite_mamba2_nope", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
         dict(GRANITE, position_embedding_type="nope", layer_types=["attention", "mamba", "mamba"],
              mamba_n_groups=1, mamba_proj_bias=True, attention_bias=True),
         dict(linear_layers=(1, 2), use_rope=False, linear_proj_bias=True, qkv_bias=True),
         ablate=dict(linear_proj_bias=False)),
    # DeepSeek (`models.mla`): latents in the pool, attention in the absorbed form.
    Case("deepseek_v3_mla", "DeepseekV3Config", "DeepseekV3ForCausalLM",
         dict(DEEPSEEK, n_shared_experts=1, routed_scaling_factor=2.5,
              rope_parameters=DEEPSEEK_YARN),
         dict(kv_lora_rank=16, q_lora_rank=24, head_dim=8, v_head_dim=12, dense_layers=(0,),
              router_order="sigmoid_topk", n_group=2, topk_group=1, norm_topk_prob=True,
              rope_interleave=True, shared_expert_intermediate_size=32,
              shared_expert_gated=False, routed_scaling_factor=2.5),
         ablate=dict(rope_interleave=False, n_group=1, attention_multiplier=None,
                     routed_scaling_factor=1.0)),
    Case("deepseek_v2_mla", "DeepseekV2Config", "DeepseekV2ForCausalLM",
         dict(DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
              n_shared_experts=2, routed_scaling_factor=1.5),
         dict(kv_lora_rank=16, q_lora_rank=0, router_order="softmax_topk", n_group=2,
              norm_topk_prob=False, shared_expert_intermediate_size=64,
              routed_scaling_factor=1.5),
         ablate=dict(n_group=1, routed_scaling_factor=1.0)),
    # gpt-oss: learned attention sinks, biases on the router and experts, the clamped
    # SwiGLU (a limit far above every value undoes the clamp alone).
    Case("gpt_oss", "GptOssConfig", "GptOssForCausalLM", GPT_OSS,
         dict(layer_windows=(5, 0), qkv_bias=True, o_bias=True, attention_sinks=True,
              moe_bias=True, swiglu_limit=1.0, swiglu_alpha=1.702, num_experts=4,
              moe_intermediate_size=32, router_order="topk_softmax",
              rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16,
                                       beta_fast=8.0, truncate=False)),
         ablate=dict(attention_sinks=False, moe_bias=False, swiglu_limit=1e9,
                     layer_windows=(0, 0), rope_scaling=RopeScaling())),
    # Gemma 4 (`models.gemma4`): each mechanism undone alone breaks agreement.
    Case("gemma4_ple_shared_kv", "Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4,
         dict(layer_windows=(5, 0, 5, 0), per_layer_input_size=8, per_layer_vocab_size=160,
              kv_shared_layers=2, attention_k_eq_v=True, double_wide_mlp=True,
              intermediate_size=192, norm_offset=0.0, attention_multiplier=1.0,
              rope_scaling=RopeScaling("proportional", partial_rotary_factor=0.25),
              rope_theta=1e6, local_rope_theta=10000.0, global_head_dim=32, global_kv_heads=1),
         ablate=dict(kv_shared_layers=0, per_layer_input_size=0, attention_k_eq_v=False,
                     layer_scalar=False, v_norm=False, rope_scaling=RopeScaling())),
    Case("gemma4_moe_block", "Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_MOE,
         dict(layer_windows=(5, 0), num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, intermediate_size=96, router_order="softmax_topk",
              norm_topk_prob=True, per_layer_input_size=0, attention_k_eq_v=True),
         # NOTE: not norm_topk_prob: renormalizing scales a token's routed sum by one factor,
         # which post_feedforward_layernorm_2 divides out (the router's scales: below).
         ablate=dict(num_experts_per_tok=1)),
    # Llama 4: every mechanism undone alone breaks agreement (the chunks first).
    Case("llama4_chunked_nope_moe", "Llama4TextConfig", "Llama4ForCausalLM", LLAMA4,
         dict(layer_windows=(-8, 0, -8), nope_layers=(1,), dense_layers=(0, 2),
              intermediate_size=96, moe_intermediate_size=32, num_experts=4,
              shared_expert_intermediate_size=32, shared_expert_gated=False,
              router_order="topk_sigmoid", qk_l2_norm=True, attn_temperature_tuning=True,
              floor_scale=4.0, attn_scale=0.5, rope_interleave=True),
         ablate=dict(layer_windows=(0, 0, 0), nope_layers=(), qk_l2_norm=False,
                     attn_temperature_tuning=False, rope_interleave=False,
                     router_order="topk_softmax")),
]


# Cases left to the slow tier (`pytest -m slow`); the default tier keeps one case per
# family and per feature, and parses every slow case's config (test_slow_cases_configs_parse):
# - llama_tied (tied embeddings, 3 layers): tied logits are compared with transformers by
#   test_smollm2_gguf_matches_transformers (SmolLM2 ties them); tests/conftest.py's tiny
#   engine model is a tied Hugging Face directory.
# - qwen2_bias (plain Qwen2: q/k/v bias, no o bias, rope_theta): qwen2_window_layers has the
#   same bias layout (its `expect` checks it), gemma3_two_ropes rope_theta apart from the
#   default.
# - qwen2_layer_types_linear_rope (Qwen2's windows from `layer_types`, linear rope scaling):
#   gemma2_softcap and gemma3_two_ropes run windows per layer (gemma3_two_ropes linear
#   scaling too) through whole models; test_slow_cases_configs_parse checks Qwen2's parse.
# - qwen3_qknorm_headdim (q/k norm, head_dim 24 apart from hidden / heads): qwen3_bias_sliding
#   is Qwen3 with q/k norm and a head_dim of its own (8) too, and biases before the norm.
# - llama_yarn (YaRN through a whole model): tests/models/test_rope_scaling.py checks its
#   tables, attention factor included, against transformers'; the tables are all it changes.
# - gemma2_global_first (a global first layer, attention soft cap alone) and
#   gemma3_pattern2_softcap (Gemma 3 with the default rotary bases, final soft cap):
#   gemma2_softcap and gemma3_two_ropes have every Gemma feature between them.
# - mixtral_moe (top-k then softmax routing, experts named w1/w2/w3): its router is compared
#   with transformers' by tests/models/test_moe.py; qwen2_moe_shared and qwen3_moe_norm_topk
#   run the MoE layer through whole models.
# - qwen3_moe_norm_topk (Qwen3-MoE with norm_topk_prob, 6 experts): qwen3_moe_mlp_only is
#   Qwen3-MoE with norm_topk_prob and q/k norm too (its `expect` checks both), beside a dense
#   layer; qwen3_next_moe_fused renormalises its top-k as well.
# - qwen3_moe_sparse_step and qwen2_moe_mixed (dense layers from decoder_sparse_step; a
#   shared expert beside dense layers): qwen3_moe_mlp_only runs the mixed layers, and
#   tests/e2e/test_moe_greedy.py serves the Qwen2-MoE one against transformers.
# - qwen3_5_moe_hybrid (Qwen3.5's layers with experts in every layer): qwen3_5_hybrid has its
#   layers and tensor names, qwen3_next_moe_fused the experts and shared expert beside linear
#   layers. (A hybrid's first compile is ~7 s here, most of it the chunked delta rule's.)
# - granite_mamba2_rope (Granite 4.0 with rotary, dense): granite_moe_nope has the same
#   Mamba-2 layers, tensor names and four multipliers (its `expect` checks the Mamba-2 fields
#   this case checked), with routed experts; tests/models/test_granite.py parses
#   position_embedding_type "rope", and rotary attention is every other family's.
# - granite_mamba2_nope (no rotary, one group, projection and attention biases, attention
#   first): granite_mamba2_rope has Granite's layers, names and multipliers, granite_moe_nope
#   attention without rotary.
# - deepseek_v2_mla (softmax routing over groups, no query low rank): deepseek_v3_mla has
#   the latent attention, names and routing machinery; tests/models/test_deepseek.py checks
#   V2's config parsing.
SLOW_CASES = ("llama_yarn", "llama_tied", "qwen2_bias", "qwen2_layer_types_linear_rope",
              "qwen3_qknorm_headdim",
              "gemma2_global_first", "gemma3_pattern2_softcap", "mixtral_moe",
              "qwen3_moe_norm_topk", "qwen3_moe_sparse_step", "qwen2_moe_mixed",
              "qwen3_5_moe_hybrid", "granite_mamba2_rope", "granite_mamba2_nope",
              "deepseek_v2_mla")


# Cases whose first ablation is left to the slow tier (test_tiny_every_feature_is_exercised
# then ablates all their fields): the default tier makes the same ablation in another case.
# - qwen2_window_layers, qwen2_layer_types_linear_rope, qwen3_bias_sliding and
#   gemma3_two_ropes (windows undone): the default tier covers this in mistral_sliding
#   (every layer windowed) and gemma2_softcap (windowed and global layers); the windows
#   each family's config gives are checked by its `expect`.
# - granite_mamba2_rope (residual_multiplier undone: a ~6 s recompile): its agreement with
#   transformers at multipliers apart from 1 (each parsed, `expect`) already needs them.
# - olmoe_full_qknorm (softmax-then-top-k routing undone): the default tier covers this in
#   qwen2_moe_shared, the same router order without norm_topk_prob.
SLOW_FIRST_ABLATIONS = ("qwen2_window_layers", "qwen2_layer_types_linear_rope",
                        "qwen3_bias_sliding", "gemma3_two_ropes", "olmoe_full_qknorm",
                        "granite_mamba2_rope")


def _params(cases: list[Case], slow: tuple[str, ...] = SLOW_CASES) -> list:
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in slow else [])
            for c in cases]


def _perturb(model, seed: int) -> None:
    """Random norm weights and biases, so they are not trivially ones and zeros."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith((".bias", "_proj_bias")):  # gpt-oss's expert biases too
                p.copy_(0.3 * noise)
            elif name.endswith(".sinks"):  # gpt-oss: logits near the attention's own
                p.copy_(noise)
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4: ones at init
                p.copy_(1.0 + 0.3 * noise)
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: selection only
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
            if name.endswith("layer_scalar"):  # Gemma 4's scalar per layer (ones at init)
                b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=gen))


def build_hf(case: Case, path: str, seed: int = 0):
    """Builds, perturbs and saves the tiny transformers model; returns it (eval, float32)."""
    config = getattr(transformers, case.config_cls)(
        **{**TINY, **case.overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, case.model_cls)(config).to(torch.float32).eval()
    _perturb(model, seed + 1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def prompt(vocab_size: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, SEQ_LEN).tolist()


@pytest.fixture(scope="module", params=_params(CASES))
def tiny(request, tmp_path_factory):
    """(case, our float32 model, prompt, transformers' logits, model directory)."""
    case = request.param
    path = tmp_path_factory.mktemp(case.name)
    hf = build_hf(case, str(path))
    ids = prompt(hf.config.vocab_size)
    ref = hf_logits(hf, ids)
    return case, load_model(str(path), "float32"), ids, ref, str(path)


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_tiny_family_matches_transformers(tiny, chunking):
    case, model, ids, ref, _ = tiny
    for field, want in case.expect.items():
        assert getattr(model.cfg, field) == want, field
    # Non-degenerate logits, so an absolute tolerance means something.
    assert ref.std() > 0.5
    assert len(set(ref.argmax(-1).tolist())) > 3

    ours = forward_logits(model, ids, page_size=PAGE_SIZE, chunks=CHUNKINGS[chunking])
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=0, atol=F32_ATOL)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in SLOW_CASES], ids=lambda c: c.name)
def test_slow_cases_configs_parse(case):
    """The slow tier's cases' configs (transformers' own, no weights) parse to their `expect`
    in the default tier: each family's parsing stays checked where its model runs slow."""
    from models.registry import arch_config_from_hf

    config = getattr(transformers, case.config_cls)(**{**TINY, **case.overrides})
    cfg = arch_config_from_hf({**config.to_dict(), "architectures": [case.model_cls]})
    for field, want in case.expect.items():
        assert getattr(cfg, field) == want, field


def _check_ablations(tiny, fields: slice):
    case, model, ids, ref, _ = tiny
    if case.ablate is None:
        pytest.skip("no ablation for this case")
    for field, value in list(case.ablate.items())[fields]:
        ablated = Model(dataclasses.replace(model.cfg, **{field: value}), model.params,
                        model.dtype, serving=model.serving)
        diff = np.abs(forward_logits(ablated, ids, page_size=PAGE_SIZE) - ref).max()
        assert diff > 100 * F32_ATOL, field


# NOTE: the `tiny` fixture's cases again (indirect: the same module-scoped models). The
# ablations check the tests themselves (that each family's case is sensitive to its
# feature), not the model: the slow tier runs them all (they took ~17 s of the default tier).
@pytest.mark.slow
@pytest.mark.parametrize("tiny", _params(CASES, SLOW_CASES + SLOW_FIRST_ABLATIONS),
                         indirect=True)
def test_tiny_features_are_exercised(tiny):
    """Undoing a case's first feature (window, rope scaling, soft cap, router) must break
    agreement (the others: `test_tiny_every_feature_is_exercised`, slow tier).

    Guards against tests passing only because the prompt is too short for the window, the
    positions too small for rope scaling to matter, or the logits below a soft cap.
    """
    _check_ablations(tiny, slice(0, 1))


@pytest.mark.slow
def test_tiny_every_feature_is_exercised(tiny):
    """Undoing any one of a case's other features must break agreement too (and its first,
    where the default tier leaves that to this test: SLOW_FIRST_ABLATIONS)."""
    first = 0 if tiny[0].name in SLOW_FIRST_ABLATIONS else 1
    if tiny[0].ablate is not None and len(tiny[0].ablate) <= first:
        pytest.skip("one feature: the default tier ablates it")
    _check_ablations(tiny, slice(first, None))


@pytest.mark.parametrize("tiny", _params([c for c in CASES if c.name == "qwen3_moe_mlp_only"]),
                         indirect=True)
def test_routed_experts_are_transformers_routers(tiny):
    """Routing capture (`Model.forward(routing=True)`) of a mixture of experts with a
    dense layer: each sparse layer's experts per token are those transformers' router
    ranks first (its `router_logits`, heaviest first); the dense layer's are -1."""
    case, model, ids, _, path = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with torch.no_grad():
        router = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    k = model.cfg.num_experts_per_tok
    ours = forward_routing(model, ids, page_size=PAGE_SIZE)  # i32[T, L, k]
    assert ours.shape == (len(ids), model.cfg.num_layers, k)
    sparse = [i for i in range(model.cfg.num_layers) if i not in model.cfg.dense_layers]
    assert len(router) == len(sparse) and model.cfg.dense_layers == (1,)
    for layer, logits in zip(sparse, router, strict=True):
        np.testing.assert_array_equal(ours[:, layer], torch.topk(logits, k).indices.numpy())
    assert (ours[:, 1] == -1).all()
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        dense = Model(dataclasses.replace(model.cfg, num_experts=0, dense_layers=()),
                      model.params, model.dtype)
        dense.forward(model.params, None, None, None, None, routing=True)


@pytest.mark.slow(reason="~7 s; the default tier compares the MoE block's logits with its "
                  "router scales drawn apart from their ones (gemma4_moe_block)")
@pytest.mark.parametrize("tiny", _params([c for c in CASES if c.name == "gemma4_moe_block"]),
                         indirect=True)
def test_gemma4_moe_routing_and_router_scales(tiny):
    """Gemma 4's MoE block: the captured experts are those transformers' router ranks first
    (its `router_logits` are the probabilities), and its drawn `scale` and
    `per_expert_scale` matter (each set back to ones breaks agreement)."""
    case, model, ids, ref, path = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with torch.no_grad():
        router = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    ours = forward_routing(model, ids, page_size=PAGE_SIZE)  # i32[T, L, k]
    assert len(router) == model.cfg.num_layers == 2
    for layer, probs in enumerate(router):
        np.testing.assert_array_equal(ours[:, layer], torch.topk(probs, 2).indices.numpy())
    for leaf in ("router_scale", "per_expert_scale"):
        params = jax.tree_util.tree_map(lambda a: a, model.params)  # a copy of the dicts
        router_params = params["layers"]["mlp"]["router"]
        router_params[leaf] = np.ones_like(router_params[leaf])
        plain = Model(model.cfg, params, model.dtype, serving=model.serving)
        assert np.abs(forward_logits(plain, ids, page_size=PAGE_SIZE) - ref).max() > 100 * F32_ATOL


@pytest.mark.parametrize("tiny", _params([c for c in CASES if c.name == "deepseek_v3_mla"]),
                         indirect=True)
# NOTE: the default tier keeps the expanded form over both passes (~3 s a form here);
# tests/kernels/test_mla_expanded.py checks the absorbed decode rows of "prefill_expanded".
@pytest.mark.parametrize("form, chunking", slow_except([
    ("expanded", "prefill_decode"), ("prefill_expanded", "prefill_decode"),
    ("expanded", "chunked"), ("prefill_expanded", "chunked")], 0))
def test_mla_forms_match_transformers(tiny, form, chunking):
    """DeepSeek's attention in the expanded form, and expanded prefill with absorbed decode
    (`ArchConfig.mla_form`): the same weights and pool give transformers' logits. The
    prefill then single-token steps run both passes (a prefill chunk, then decode rows)."""
    case, model, ids, ref, _ = tiny
    formed = Model(dataclasses.replace(model.cfg, mla_form=form), model.params, model.dtype,
                   serving=model.serving)
    ours = forward_logits(formed, ids, page_size=PAGE_SIZE, chunks=CHUNKINGS[chunking])
    np.testing.assert_allclose(ours, ref, rtol=0, atol=F32_ATOL)


def test_bfloat16_close_to_float32(tmp_path):
    """A bfloat16 load runs through the paged cache and stays close to float32."""
    case = CASES[0]
    build_hf(case, str(tmp_path), seed=3)
    m32 = load_model(str(tmp_path), "float32")
    m16 = load_model(str(tmp_path), "bfloat16")
    assert m16.params["embed_tokens"]["embedding"].dtype == np.dtype("bfloat16")
    ids = prompt(m32.cfg.vocab_size, seed=3)
    ref = forward_logits(m32, ids, page_size=PAGE_SIZE)
    low = forward_logits(m16, ids, page_size=PAGE_SIZE, chunks=CHUNKINGS["chunked"])
    assert low.dtype == np.float32 and np.isfinite(low).all()
    assert np.abs(low - ref).max() < 0.1 * np.abs(ref).max()
    assert (low.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


SMOLLM2_PROMPT = ("The quick brown fox jumps over the lazy dog. Paged attention stores the "
                  "key and value cache in fixed-size blocks")


@pytest.mark.parametrize("chunks", [None, (11, 1, 1)], ids=["whole", "chunked"])
def test_smollm2_gguf_matches_transformers(smollm2, hf_smollm2, smollm2_tokenizer, chunks):
    ids = smollm2_tokenizer(SMOLLM2_PROMPT)["input_ids"]
    assert 20 <= len(ids) <= 30, len(ids)
    if chunks is not None:
        chunks = (*chunks, len(ids) - sum(chunks))
    ref = hf_logits(hf_smollm2, ids)
    ours = forward_logits(smollm2, ids, page_size=16, chunks=chunks)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-3)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("backend", [
    "cpu", pytest.param("pallas", marks=pytest.mark.slow)])
def test_gemma2_soft_caps_on_kernel_backends(backend, tmp_path):
    """The attention soft cap reaches the CPU decode kernel and the Pallas ragged kernel
    (interpreted here) as it reaches the XLA path: the same logits as transformers. (The
    paged decode kernel's soft cap: tests/kernels/test_paged_decode_attention.py.)"""
    from pallas_kernels import cpu_ffi

    if backend == "cpu" and not cpu_ffi.available():
        pytest.skip(f"no CPU kernel here: {cpu_ffi.unavailable_reason()}")
    case = next(c for c in CASES if c.name == "gemma2_softcap")
    hf = build_hf(case, str(tmp_path))
    ids = prompt(hf.config.vocab_size)
    model = load_model(str(tmp_path), "float32", serving=ServingChoice(backend))
    assert model.methods.backend == backend
    ours = forward_logits(model, ids, page_size=PAGE_SIZE, chunks=CHUNKINGS["prefill_decode"])
    np.testing.assert_allclose(ours, hf_logits(hf, ids), rtol=0, atol=F32_ATOL)


@pytest.mark.slow(reason="a whole model in the Pallas interpreter: ~20 s")
def test_llama4_chunks_on_the_pallas_kernels(tmp_path):
    """Llama 4's chunked layers (chunks of 8 over the 24-token prompt) through the Pallas
    ragged and decode kernels (interpreted here), the chunk a traced kernel scalar from the
    layer scan's window table: the same logits as transformers."""
    case = next(c for c in CASES if c.name == "llama4_chunked_nope_moe")
    hf = build_hf(case, str(tmp_path))
    ids = prompt(hf.config.vocab_size)
    model = load_model(str(tmp_path), "float32", serving=ServingChoice("pallas"))
    assert model.methods.backend == "pallas"
    ours = forward_logits(model, ids, page_size=PAGE_SIZE, chunks=CHUNKINGS["prefill_decode"])
    np.testing.assert_allclose(ours, hf_logits(hf, ids), rtol=0, atol=F32_ATOL)

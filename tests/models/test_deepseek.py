"""DeepSeek-V2/V3 config parsing, its errors, the latent page pool's size, and what is refused.

The numerics (latent attention, routing, shared experts, dense layers) are compared with
transformers in tests/models/test_numerics.py (`deepseek_v3_mla`, `deepseek_v2_mla`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.parallel.layouts import make_tensor_parallel
from jaxserve.runner.sizing import page_bytes
from models.deepseek_config import yarn_mscale
from models.mla import deinterleave, kv_bytes_report
from models.model import Model
from models.moe import route
from models.registry import arch_config_from_hf

V3 = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=160, hidden_size=64,
          intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
          qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
          n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
          n_shared_experts=1)
V2 = dict(V3, architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None,
          topk_method="group_limited_greedy")


def test_v3_fields_and_transformers_defaults():
    cfg = arch_config_from_hf(V3)
    assert (cfg.is_mla, cfg.latent_dim, cfg.head_dim, cfg.q_lora_rank) == (True, 24, 8, 24)
    assert (cfg.router_order, cfg.n_group, cfg.topk_group) == ("sigmoid_topk", 2, 1)
    assert (cfg.dense_layers, cfg.shared_expert_intermediate_size) == ((0,), 32)
    assert not cfg.shared_expert_gated and cfg.rope_interleave
    assert cfg.attention_multiplier == pytest.approx(16 ** -0.5)
    # transformers' DeepseekV3Config defaults where the config is silent.
    bare = {k: v for k, v in V3.items() if k not in ("routed_scaling_factor", "norm_topk_prob")}
    assert arch_config_from_hf(bare).routed_scaling_factor == 2.5
    assert arch_config_from_hf(bare).norm_topk_prob


def test_v2_fields():
    cfg = arch_config_from_hf(V2)
    assert (cfg.q_lora_rank, cfg.router_order, cfg.n_group, cfg.norm_topk_prob) == (
        0, "softmax_topk", 2, False)
    greedy = arch_config_from_hf({**V2, "topk_method": "greedy"})
    assert (greedy.n_group, greedy.topk_group) == (1, 1)


def test_yarn_mscale_scales_the_softmax():
    rope = {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0,
            "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = arch_config_from_hf({**V3, "rope_parameters": rope, "max_position_embeddings": 640})
    assert cfg.attention_multiplier == pytest.approx(16 ** -0.5 * yarn_mscale(40.0, 1.0) ** 2)


@pytest.mark.parametrize("change, field", [
    (dict(n_group=3), "n_group"),
    (dict(topk_group=3), "topk_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(n_group=8, topk_group=2), "n_group"),  # one expert a group: no two best
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(v_head_dim=0), "v_head_dim"),
    (dict(q_lora_rank=-1), "q_lora_rank"),
    (dict(first_k_dense_replace=3), "first_k_dense_replace"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
])
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        arch_config_from_hf({**V3, **change})


@pytest.mark.parametrize("change, field", [
    (dict(topk_method="noaux_tc"), "topk_method"),
    (dict(norm_topk_prob=True), "norm_topk_prob"),
])
def test_bad_v2_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        arch_config_from_hf({**V2, **change})


def test_arch_config_checks_mla_fields():
    cfg = arch_config_from_hf(V3)
    with pytest.raises(ValueError, match="qk_nope_head_dim"):
        dataclasses.replace(cfg, qk_nope_head_dim=0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        dataclasses.replace(cfg, kv_lora_rank=0)  # the other widths need MLA
    with pytest.raises(ValueError, match="qk_norm"):
        dataclasses.replace(cfg, qk_norm=True)
    with pytest.raises(ValueError, match="mla_form"):
        dataclasses.replace(cfg, mla_form="latent")
    assert dataclasses.replace(cfg, mla_form="prefill_expanded").mla_form == "prefill_expanded"
    with pytest.raises(ValueError, match="mla_form='expanded' needs multi-head latent"):
        dataclasses.replace(cfg, kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0,
                            v_head_dim=0, mla_form="expanded")


def test_grouped_sigmoid_routing_picks_within_the_best_group():
    """Experts 0-3 and 4-7 in two groups; the bias moves selection, not the weights."""
    logits = jnp.asarray([[3.0, 2.0, -5.0, -5.0, 2.5, 2.4, 2.3, -5.0]])
    bias = jnp.zeros(8).at[1].set(-10.0)
    weights, ids = route(logits, 2, "sigmoid_topk", True, n_group=2, topk_group=1,
                         scale=2.0, bias=bias)
    # biased, group 0 scores sigmoid(3) + sigmoid(-5); group 1 wins by its two best.
    assert sorted(np.asarray(ids)[0].tolist()) == [4, 5]
    s = 1 / (1 + np.exp(-np.array([2.5, 2.4])))
    np.testing.assert_allclose(np.sort(np.asarray(weights)[0]), np.sort(2 * s / s.sum()),
                               rtol=1e-6)


def test_deinterleave_matches_pairwise_rotation():
    """Half-split rotary of the deinterleaved channels is transformers' interleaved one."""
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(deinterleave(jnp.asarray(x))),
                                  [0, 2, 4, 6, 1, 3, 5, 7])


def test_latent_pool_holds_more_tokens():
    """One latent row per token and layer: a page costs L * page_size * (R + Dr) values,
    so a KV budget holds (H * (Dn + Dr + Dv)) / (R + Dr) times the GQA layout's tokens."""
    cfg = arch_config_from_hf(V3)
    model = Model(cfg, None)
    assert model.kv_pages_shape(5, 4) == (3, 1, 1, 5, 4, 24)
    per_page = page_bytes(model, 16)
    assert per_page == 3 * 16 * 24 * 4
    gqa_per_page = 3 * 16 * 4 * (8 + 8 + 12) * 4  # K and V of every head, float32
    budget = 1 << 20
    ratio = (budget // per_page) / (budget // gqa_per_page)
    assert ratio == pytest.approx(4 * 28 / 24, rel=0.02)
    assert "x4.7 the tokens" in kv_bytes_report(cfg, 4)


def test_tensor_parallelism_splits_heads_and_keeps_the_latent_pool_whole():
    """Plain tensor parallelism: q_b and kv_b split by heads, o_proj by its input, q_a
    and kv_a (the latent, the same on every device) and the latent pool replicated."""
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 (CPU) devices")
    layout = make_tensor_parallel(arch_config_from_hf(V3), 2)
    assert layout.kv_pages_sharding().spec == P()
    attn = {"q_a_proj": {"kernel": np.zeros((64, 24))}, "q_b_proj": {"kernel": np.zeros((24, 64))},
            "kv_a_proj_with_mqa": {"kernel": np.zeros((64, 24))},
            "kv_b_proj": {"kernel": np.zeros((16, 80))}, "o_proj": {"kernel": np.zeros((48, 64))}}
    specs = layout.param_specs({"layers": {"self_attn": attn}})["layers"]["self_attn"]
    split = ("kv", "rep")
    assert specs["q_b_proj"]["kernel"] == P(None, split)
    assert specs["kv_b_proj"]["kernel"] == P(None, split)
    assert specs["o_proj"]["kernel"] == P(split, None)
    assert specs["q_a_proj"]["kernel"] == P() and specs["kv_a_proj_with_mqa"]["kernel"] == P()

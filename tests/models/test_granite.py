"""Granite 4.0 (`GraniteMoeHybridForCausalLM`): config parsing and its errors, the Mamba-2 state
pools' shapes, the checkpoint names (the routed experts' stacked tensors too), and tensor
parallelism refused.

Numerics against transformers: the granite cases of tests/models/test_numerics.py (routed
experts: granite_moe_nope).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.parallel.layouts import make_tensor_parallel
from models.gated_deltanet import state_bytes_per_slot, state_shapes
from models.loaders.granite_names import get_granite, granite_name
from models.registry import arch_config_from_hf

HF = dict(architectures=["GraniteMoeHybridForCausalLM"], vocab_size=64, hidden_size=32,
          intermediate_size=48, shared_intermediate_size=40, num_hidden_layers=3,
          num_attention_heads=2, num_key_value_heads=1, num_local_experts=0,
          layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=16,
          mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, position_embedding_type="nope",
          embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
          attention_multiplier=0.0078125)


def test_fields_and_state_shapes():
    cfg = arch_config_from_hf(HF)
    assert cfg.linear_kind == "mamba2" and cfg.linear_layers == (0, 2)
    assert cfg.attention_layers == (1,) and not cfg.use_rope
    assert cfg.intermediate_size == 40 and cfg.linear_conv_bias and not cfg.linear_proj_bias
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling,
            cfg.attention_multiplier) == (12.0, 0.22, 8.0, 0.0078125)
    assert cfg.linear_conv_dim == 4 * 16 + 2 * 2 * 8  # x, B and C
    shapes = state_shapes(cfg, 5)
    assert shapes["conv"].shape == (2, 5, 3, 96)
    assert shapes["recurrent"].shape == (2, 5, 4, 16, 8)  # [L_m, S, H, P, N]
    assert state_bytes_per_slot(cfg) == 4 * 2 * (3 * 96 + 4 * 16 * 8)
    # Granite's published names and transformers 5's, and d_head "auto" (128 / 4 heads).
    same = arch_config_from_hf({**HF, "layer_types": None, "mamba_d_head": "auto",
                                "layers_block_type": ["linear_attention", "full_attention",
                                                      "mamba"],
                                "position_embedding_type": "rope",
                                "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert same.linear_layers == (0, 2) and same.use_rope and same.linear_value_head_dim == 16
    dense = arch_config_from_hf({**HF, "layer_types": ["attention"] * 3})
    assert not dense.has_linear_attention  # Granite 4.0 micro: every layer attends
    assert not cfg.is_moe and not cfg.shared_expert_intermediate_size


def test_routed_expert_fields():
    """Granite 4.0-H Tiny and Small: experts of `intermediate_size` routed top-k then
    softmax, the shared MLP an ungated shared expert; transformers' defaults (8 experts,
    top 2) when the config omits them."""
    cfg = arch_config_from_hf({**HF, "num_local_experts": 4, "num_experts_per_tok": 3})
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 3, 48)
    assert cfg.router_order == "topk_softmax" and cfg.sparse_layers == (0, 1, 2)
    assert cfg.shared_expert_intermediate_size == 40 and not cfg.shared_expert_gated
    defaults = {k: v for k, v in HF.items() if k != "num_local_experts"}
    cfg = arch_config_from_hf(defaults)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["mamba", "sliding_attention", "attention"]),
     "unsupported layer_types entry 'sliding_attention'"),
    (dict(layer_types=["mamba", "attention"]), "layer_types has 2 entries"),
    (dict(layer_types=["mamba"] * 3), "leaves no full_attention layer"),
    (dict(mamba_d_head=8), r"mamba_d_head=8 x mamba_n_heads=4 must be mamba_expand \* "
                           "hidden_size = 64"),
    (dict(mamba_n_heads=3, mamba_d_head="auto"), "mamba_d_head=21 x mamba_n_heads=3"),
    (dict(mamba_n_groups=3), r"mamba_n_heads \(4\) must be a multiple of mamba_n_groups"),
    (dict(mamba_d_state=0), "mamba_d_state=0"),
    (dict(mamba_d_conv="4"), "mamba_d_conv='4'"),
    (dict(num_local_experts=-1), "num_local_experts=-1 .* must be an integer >= 0"),
    (dict(num_local_experts=2.5), "num_local_experts=2.5"),
    (dict(num_local_experts=4, num_experts_per_tok=5),
     r"num_experts_per_tok=5 must be in 1..num_experts \(4\)"),
    (dict(num_local_experts=4, num_experts_per_tok=0), "num_experts_per_tok=0"),
    (dict(num_local_experts=4, intermediate_size=0), "intermediate_size=0"),
    (dict(shared_intermediate_size=0), "shared_intermediate_size=0"),
    (dict(position_embedding_type="alibi"), "position_embedding_type 'alibi'"),
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act='gelu_pytorch_tanh'"),
    (dict(time_step_limit=[0.001, 0.1]), "time_step_limit"),
    (dict(logits_scaling=0.0), "logits_scaling must be positive"),
])
def test_bad_configs_name_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        arch_config_from_hf({**HF, **change})


def test_unknown_linear_kind():
    import dataclasses

    with pytest.raises(ValueError, match="unsupported linear_kind 'rwkv'"):
        dataclasses.replace(arch_config_from_hf(HF), linear_kind="rwkv")


def test_checkpoint_names():
    assert granite_name("model.layers.0.linear_attn.conv1d.weight") == (
        "model.layers.0.mamba.conv1d.weight", None, None)
    assert granite_name("model.layers.1.mlp.up_proj.weight") == (
        "model.layers.1.shared_mlp.input_linear.weight", 1, None)
    assert granite_name("model.layers.1.self_attn.q_proj.weight")[0] == (
        "model.layers.1.self_attn.q_proj.weight")
    cfg = arch_config_from_hf(HF)
    fused = np.arange(80 * 2).reshape(80, 2)

    class Source:
        def get(self, name):
            return {"model.layers.0.shared_mlp.input_linear.weight": fused}[name]

    up = get_granite(Source(), cfg, "model.layers.0.mlp.up_proj.weight")
    np.testing.assert_array_equal(up, fused[40:])
    with pytest.raises(ValueError, match="has 80 rows, expected 2 x shared_intermediate_size"):
        get_granite(Source(), arch_config_from_hf({**HF, "shared_intermediate_size": 16}),
                    "model.layers.0.mlp.gate_proj.weight")


def test_routed_expert_checkpoint_names():
    """Each expert's gate, up and down are cut from its layer's stacks (`input_linear`
    [E, 2 I, H]: gate rows then up; `output_linear` [E, H, I]); the router is
    `router.layer`; the shared MLP is the MoE layer's shared expert."""
    assert granite_name("model.layers.2.mlp.experts.3.up_proj.weight") == (
        "model.layers.2.block_sparse_moe.input_linear.weight", 1, 3)
    assert granite_name("model.layers.0.mlp.experts.1.down_proj.weight") == (
        "model.layers.0.block_sparse_moe.output_linear.weight", None, 1)
    assert granite_name("model.layers.0.mlp.gate.weight") == (
        "model.layers.0.block_sparse_moe.router.layer.weight", None, None)
    assert granite_name("model.layers.1.mlp.shared_expert.gate_proj.weight") == (
        "model.layers.1.shared_mlp.input_linear.weight", 0, None)
    cfg = arch_config_from_hf({**HF, "num_local_experts": 3})
    rng = np.random.default_rng(0)
    stacks = {"model.layers.0.block_sparse_moe.input_linear.weight": rng.random((3, 96, 32)),
              "model.layers.0.block_sparse_moe.output_linear.weight": rng.random((3, 32, 48)),
              "model.layers.0.shared_mlp.input_linear.weight": rng.random((80, 32))}

    class Source:
        def get(self, name):
            return stacks[name]

    fused = stacks["model.layers.0.block_sparse_moe.input_linear.weight"]
    np.testing.assert_array_equal(
        get_granite(Source(), cfg, "model.layers.0.mlp.experts.2.gate_proj.weight"),
        fused[2, :48])
    np.testing.assert_array_equal(
        get_granite(Source(), cfg, "model.layers.0.mlp.experts.2.up_proj.weight"),
        fused[2, 48:])
    np.testing.assert_array_equal(
        get_granite(Source(), cfg, "model.layers.0.mlp.experts.0.down_proj.weight"),
        stacks["model.layers.0.block_sparse_moe.output_linear.weight"][0])
    np.testing.assert_array_equal(
        get_granite(Source(), cfg, "model.layers.0.mlp.shared_expert.up_proj.weight"),
        stacks["model.layers.0.shared_mlp.input_linear.weight"][40:])
    with pytest.raises(ValueError, match=r"input_linear.weight' has shape \(3, 96, 32\), "
                                         "expected num_local_experts = 4"):
        get_granite(Source(), arch_config_from_hf({**HF, "num_local_experts": 4}),
                    "model.layers.0.mlp.experts.0.gate_proj.weight")
    with pytest.raises(ValueError, match="has 96 rows, expected 2 x intermediate_size = 64"):
        get_granite(Source(), arch_config_from_hf({**HF, "num_local_experts": 3,
                                                   "intermediate_size": 32}),
                    "model.layers.0.mlp.experts.0.up_proj.weight")


def test_tensor_parallel_keeps_mamba_layers_whole(caplog):
    """Tensor parallelism replicates the Mamba-2 layers' weights and state pools (the
    engine's TP 2 tokens: tests/e2e/test_hybrid_engine.py) and says so; attention splits."""
    from jax.sharding import PartitionSpec as P

    from models.model import random_params

    cfg = arch_config_from_hf(HF)
    with caplog.at_level("WARNING", logger="jaxserve"):
        tp = make_tensor_parallel(cfg, 2)
    assert not tp.split_linear and "Mamba-2 layers and their state are replicated" in caplog.text
    specs = tp.param_specs(random_params(cfg, seed=0))["layers"]
    assert all(s == P() for s in jax.tree_util.tree_leaves(
        specs["linear_attn"], is_leaf=lambda x: isinstance(x, P)))
    assert specs["self_attn"]["q_proj"]["kernel"] != P()
    assert all(s.is_fully_replicated for s in tp.state_shardings().values())

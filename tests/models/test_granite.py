"""Granite 4.0 (`GraniteMoeHybridForCausalLM`): config parsing and its errors, the Mamba-2 state
pools' shapes, the checkpoint names, and tensor parallelism refused.

Numerics against transformers: the granite cases of tests/models/test_numerics.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.parallel.sharding import make_tensor_parallel
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
    (dict(num_local_experts=4), "num_local_experts=4"),
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
        "model.layers.0.mamba.conv1d.weight", None)
    assert granite_name("model.layers.1.mlp.up_proj.weight") == (
        "model.layers.1.shared_mlp.input_linear.weight", 1)
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


def test_tensor_parallel_is_refused_for_mamba_layers():
    with pytest.raises(ValueError, match="linear_kind='mamba2'"):
        make_tensor_parallel(arch_config_from_hf(HF), 2)

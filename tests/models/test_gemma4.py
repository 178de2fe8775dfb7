"""Gemma 4's config parsing (`models.registry_gemma4`, `models.gemma4_config`,
`models.gemma4_moe`): transformers' defaults, the KV-shared layers' sources and pool slots,
the MoE block's fields and checkpoint names, and each bad config a `ValueError` naming its
field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from models.gemma4_config import kv_slot_index, kv_sources
from models.gemma4_moe import has_moe_block
from models.loaders.gemma4_moe_names import Gemma4MoESource
from models.lora import served_targets
from models.registry import arch_config_from_hf

BASE = dict(architectures=["Gemma4ForCausalLM"], vocab_size=160, hidden_size=64,
            intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=160)


# The MoE block's fields (`models.gemma4_moe`).
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


class DictSource:
    """A `TensorSource` over a dict of arrays (names are their own place)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name):
        return self.tensors[name]

    def where(self, name):
        return name


def parse(**changes):
    return arch_config_from_hf({**BASE, **changes})


def test_fields_and_defaults():
    cfg = parse()
    assert cfg.layer_windows == (5, 0, 5, 0) and cfg.tie_word_embeddings
    assert cfg.rope_scaling.rope_type == "proportional"
    assert cfg.rope_scaling.partial_rotary_factor == 0.25 and cfg.rope_theta == 1e6
    assert cfg.local_rope_theta == 10000.0 and cfg.attention_multiplier == 1.0
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (8, 160)
    assert cfg.kv_shared_layers == 0 and cfg.attention_layers == (0, 1, 2, 3)
    # transformers forces the last layer to full attention
    assert parse(layer_types=["sliding_attention"] * 4).layer_windows == (5, 5, 5, 0)


def test_shared_layers_read_the_last_earlier_layer_of_their_kind():
    cfg = parse(num_kv_shared_layers=2, use_double_wide_mlp=True)
    assert kv_sources(cfg) == (0, 1, 0, 1)
    assert cfg.attention_layers == (0, 1) and kv_slot_index(cfg) == (0, 1, 0, 1)
    assert cfg.double_wide_mlp and cfg.intermediate_size == 192
    three = parse(num_hidden_layers=5, num_kv_shared_layers=1,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention",
                               "sliding_attention", "full_attention"])
    assert kv_sources(three) == (0, 1, 2, 3, 2)
    # no shared layers: the double-wide MLP stays as wide as the config says
    assert not parse(use_double_wide_mlp=True).double_wide_mlp


def test_full_attention_layers_take_their_own_head_shape():
    # transformers' default global_head_dim is 512; KV heads follow only with k_eq_v
    wide = parse(global_head_dim=None)
    assert (wide.head_dim, wide.num_kv_heads) == (16, 2)
    assert (wide.global_head_dim, wide.global_kv_heads) == (512, 2)
    assert wide.kv_pool_heads == (2, 512)
    k_eq_v = parse(global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1)
    assert (k_eq_v.global_head_dim, k_eq_v.global_kv_heads) == (32, 1)
    assert k_eq_v.kv_pool_heads == (2, 32)
    assert parse(global_head_dim=32, num_global_key_value_heads=1).global_kv_heads == 2
    # a saved config's per_layer_config gives the shapes and no defaults apply
    saved = parse(global_head_dim=None, per_layer_config={"1": {"head_dim": 32},
                                                          "3": {"head_dim": 32}})
    assert (saved.global_head_dim, saved.global_kv_heads) == (32, 2)
    # one kind of layer only: its shape is the model's
    full = parse(global_head_dim=32, layer_types=["full_attention"] * 4, sliding_window=None)
    assert (full.head_dim, full.has_global_heads) == (32, False)
    # adapters then change the MLP alone (one LoRA stack cannot hold two attention shapes)
    assert {block for block, _ in served_targets(wide)} == {"mlp"}
    assert {block for block, _ in served_targets(full)} == {"self_attn", "mlp"}


def test_moe_block_fields():
    """`enable_moe_block` serves experts beside every layer's dense MLP (`has_moe_block`),
    routed as "softmax_topk" renormalized; its fields are read only with the flag set."""
    cfg = parse(**MOE)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.router_order == "softmax_topk" and cfg.norm_topk_prob and has_moe_block(cfg)
    assert cfg.intermediate_size == 96 and not cfg.is_mixed
    off = parse(**dict(MOE, enable_moe_block=False))
    assert off.num_experts == 0 and not has_moe_block(off)


def test_moe_checkpoint_names_and_a_bad_expert_stack():
    """The block's tensors are read from transformers' names (the router, norms and stacked
    experts on the layer, gate the first half of `gate_up_proj`'s rows), and a stack whose
    rows are not 2 x moe_intermediate_size is a `ValueError` naming the tensor."""
    cfg = parse(**MOE)
    gate_up = np.arange(4 * 64 * 64, dtype=np.float32).reshape(4, 64, 64)  # [E, 2 I, H]
    down = np.ones((4, 64, 32), np.float32)  # [E, H, I]
    tensors = {"model.layers.1.experts.gate_up_proj": gate_up,
               "model.layers.1.experts.down_proj": down,
               "model.layers.1.router.scale": np.ones(64, np.float32),
               "model.layers.1.mlp.gate_proj.weight": np.zeros((96, 64), np.float32)}
    source = Gemma4MoESource(DictSource(tensors), cfg)
    np.testing.assert_array_equal(source.get("model.layers.1.mlp.experts.2.gate_proj.weight"),
                                  gate_up[2, :32])
    np.testing.assert_array_equal(source.get("model.layers.1.mlp.experts.2.up_proj.weight"),
                                  gate_up[2, 32:])
    assert source.get("model.layers.1.mlp.experts.3.down_proj.weight").shape == (64, 32)
    assert source.get("model.layers.1.mlp.router.scale").shape == (64,)
    assert source.get("model.layers.1.mlp.gate_proj.weight").shape == (96, 64)  # the dense MLP
    assert source.where("model.layers.1.mlp.experts.0.up_proj.weight") == \
        "model.layers.1.experts.gate_up_proj"
    narrow = Gemma4MoESource(DictSource({**tensors, "model.layers.1.experts.gate_up_proj":
                                         gate_up[:, :60]}), cfg)
    with pytest.raises(ValueError, match="experts.gate_up_proj.*2 x moe_intermediate_size"):
        narrow.get("model.layers.1.mlp.experts.0.gate_proj.weight")


def test_multimodal_checkpoint_serves_its_text_config():
    text = {k: v for k, v in BASE.items() if k != "architectures"}
    cfg = arch_config_from_hf({"architectures": ["Gemma4ForConditionalGeneration"],
                               "text_config": text, "vision_config": {}})
    assert cfg.layer_windows == (5, 0, 5, 0) and cfg.per_layer_input_size == 8


@pytest.mark.parametrize("changes, field", [
    (dict(enable_moe_block=True), "num_experts"),
    (dict(MOE, num_experts=0), "num_experts"),
    (dict(MOE, top_k_experts=None), "top_k_experts"),
    (dict(MOE, top_k_experts=True), "top_k_experts"),
    (dict(MOE, moe_intermediate_size=-32), "moe_intermediate_size"),
    (dict(MOE, top_k_experts=5), "top_k_experts=5 must be at most num_experts=4"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 64}}),
     "per_layer_config"),  # two full-attention shapes
    (dict(attention_k_eq_v=True, num_global_key_value_heads=3),
     "num_global_key_value_heads"),  # does not divide the 4 query heads
    (dict(layer_types=["full_attention"] * 3), "layer_types"),
    (dict(num_kv_shared_layers=4), "num_kv_shared_layers"),
    (dict(num_kv_shared_layers=3), "num_kv_shared_layers"),  # layer 1 full: none for 2
    (dict(hidden_size_per_layer_input=-1), "hidden_size_per_layer_input"),
    (dict(vocab_size_per_layer_input=0), "vocab_size_per_layer_input"),
    (dict(hidden_activation="relu"), "hidden_activation"),
])
def test_bad_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        parse(**changes)


def test_bad_arch_fields_name_the_field():
    cfg = parse(num_kv_shared_layers=2, use_double_wide_mlp=True)
    with pytest.raises(ValueError, match="use_double_wide_mlp"):
        dataclasses.replace(cfg, intermediate_size=97)
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        dataclasses.replace(cfg, linear_layers=(0,), linear_num_key_heads=1,
                            linear_num_value_heads=1, linear_key_head_dim=8,
                            linear_value_head_dim=8, linear_conv_kernel_dim=4)


@pytest.mark.parametrize("changes, field", [
    (dict(attention_multiplier=None), "attention_multiplier"),
    (dict(layer_windows=(0, 0, 0, 0)), "layer_windows"),
    (dict(global_head_dim=-1), "global_head_dim"),
    (dict(attn_output_gate=True), "global_head_dim"),
])
def test_bad_global_heads_name_the_field(changes, field):
    cfg = parse(global_head_dim=32)
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(cfg, **changes)

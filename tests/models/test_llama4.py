"""Llama 4's config parsing (transformers' `Llama4TextConfig` defaults and derivations, a
ForConditionalGeneration's text_config), its stacked experts' names, and bad configs as
ValueErrors naming the field. Fast: configs and tiny arrays only."""

from __future__ import annotations

import numpy as np
import pytest

from models.loaders.llama4_names import Llama4Source
from models.registry import arch_config_from_hf

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_local_experts=4, max_position_embeddings=64)


def parse(**fields):
    return arch_config_from_hf({"architectures": ["Llama4ForCausalLM"], **SMALL, **fields})


def test_transformers_defaults_derive_the_same_layers():
    """Without `no_rope_layers`, `moe_layers` and `layer_types`, the layers transformers'
    config derives: every 4th layer NoPE and full, the others chunked; MoE every step."""
    hf = transformers.Llama4TextConfig(**SMALL, interleave_moe_layer_step=2,
                                       attention_chunk_size=16).to_dict()
    cfg = arch_config_from_hf({**hf, "architectures": ["Llama4ForCausalLM"]})
    types = hf["layer_types"]
    assert cfg.layer_windows == tuple(-16 if t == "chunked_attention" else 0 for t in types)
    assert cfg.nope_layers == tuple(i for i, r in enumerate(hf["no_rope_layers"]) if not r)
    assert cfg.nope_layers == (3,) and cfg.layer_windows == (-16, -16, -16, 0)
    assert cfg.sparse_layers == tuple(hf["moe_layers"]) == (1, 3)
    assert cfg.intermediate_size == 96 and cfg.moe_intermediate_size == 32
    assert cfg.router_order == "topk_sigmoid" and not cfg.shared_expert_gated
    assert cfg.rope_interleave and cfg.qk_l2_norm and cfg.attn_temperature_tuning
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 500000.0


def test_no_chunk_and_dense_only():
    cfg = parse(attention_chunk_size=None, moe_layers=[])
    assert cfg.layer_windows == (0,) * 4 and not cfg.is_moe and cfg.intermediate_size == 96


def test_conditional_generation_reads_its_text_config():
    hf = {"architectures": ["Llama4ForConditionalGeneration"],
          "text_config": dict(SMALL, attention_chunk_size=8), "vision_config": {}}
    cfg = arch_config_from_hf(hf)
    assert cfg.architecture == "Llama4ForConditionalGeneration"
    assert cfg.layer_windows == (-8, -8, -8, 0)


@pytest.mark.parametrize("fields,name", [
    (dict(layer_types=["chunked_attention"] * 3 + ["sliding_attention"]), "layer_types"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(attention_chunk_size=0), "attention_chunk_size"),
    (dict(no_rope_layers=[1, 0, 2, 1]), "no_rope_layers"),
    (dict(no_rope_layers=[1, 0]), "no_rope_layers"),
    (dict(no_rope_layer_interval=0), "no_rope_layer_interval"),
    (dict(moe_layers=[5]), "moe_layers"),
    (dict(interleave_moe_layer_step=0), "interleave_moe_layer_step"),
    (dict(floor_scale=0), "floor_scale"),
    (dict(attn_scale=-1.0), "attn_scale"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
])
def test_bad_configs_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        parse(**fields)


class Stacks:
    """A tiny checkpoint: one layer's stacked experts and a router, by Llama 4's names."""

    def __init__(self, cols: int = 6):
        rng = np.random.default_rng(0)
        self.t = {"model.layers.0.feed_forward.experts.gate_up_proj": rng.random((2, 4, cols)),
                  "model.layers.0.feed_forward.experts.down_proj": rng.random((2, 3, 4)),
                  "model.layers.0.feed_forward.router.weight": rng.random((2, 4))}

    def get(self, name):
        return self.t[name]

    def where(self, name):
        return "ckpt"


def test_stacked_experts_split_gate_then_up():
    """gate the first half of gate_up_proj's columns, up the second (transformers'
    `chunk(2)`), each served as a Linear's [out, in]; the router under the decoder's name."""
    src = Llama4Source(Stacks())
    gate_up = src.source.t["model.layers.0.feed_forward.experts.gate_up_proj"]
    np.testing.assert_array_equal(src.get("model.layers.0.mlp.experts.1.gate_proj.weight"),
                                  gate_up[1][:, :3].T)
    np.testing.assert_array_equal(src.get("model.layers.0.mlp.experts.1.up_proj.weight"),
                                  gate_up[1][:, 3:].T)
    np.testing.assert_array_equal(src.get("model.layers.0.mlp.experts.0.down_proj.weight"),
                                  src.source.t["model.layers.0.feed_forward.experts.down_proj"][0].T)
    assert src.get("model.layers.0.mlp.gate.weight").shape == (2, 4)


def test_odd_gate_up_is_an_error():
    with pytest.raises(ValueError, match="gate_up_proj"):
        Llama4Source(Stacks(cols=5)).get("model.layers.0.mlp.experts.0.gate_proj.weight")

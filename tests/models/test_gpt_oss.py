"""gpt-oss (`models.registry.GptOss`): its config as transformers' `GptOssConfig` reads it,
bad fields refused by name, the clamped SwiGLU against transformers' `_apply_gate`, and
the MXFP4 checkpoints (`quant_method: "mxfp4"`) served as stored, equal to transformers'
dequantizing load of the same file. (Float numerics: the `gpt_oss` case of
tests/models/test_numerics.py.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.loaders import load_model
from models.moe_act import ClampedSwiGLU, glu
from models.registry import arch_config_from_hf
from models.rope import RopeScaling
from tests.models.helpers import (
    checkpoint_variant,
    forward_logits,
    hf_logits,
    set_quantization_config,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.gpt_oss_mxfp4 import dequantized_hf, write_mxfp4  # noqa: E402
from tests.models.test_numerics import CASES, TINY, build_hf, prompt  # noqa: E402

ARCH = ["GptOssForCausalLM"]
# The published gpt-oss-20b config.json's fields that matter here (rope as `rope_scaling`).
GPT_OSS_20B = dict(architectures=ARCH, vocab_size=201088, hidden_size=2880,
                   intermediate_size=2880, num_hidden_layers=4, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
                   rope_theta=150000, swiglu_limit=7.0, max_position_embeddings=131072,
                   layer_types=["sliding_attention", "full_attention"] * 2, hidden_act="silu",
                   rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096,
                                 "rope_type": "yarn", "truncate": False})


def test_published_config_parses():
    cfg = arch_config_from_hf(GPT_OSS_20B)
    assert cfg.layer_windows == (128, 0, 128, 0) and cfg.head_dim == 64
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.router_order == "topk_softmax" and cfg.moe_bias and cfg.attention_sinks
    assert cfg.qkv_bias and cfg.o_bias and cfg.rms_norm_eps == 1e-5
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702) and cfg.rope_theta == 150000.0
    assert cfg.rope_scaling == RopeScaling("yarn", factor=32.0, beta_fast=32.0, truncate=False,
                                           original_max_position_embeddings=4096)


def test_defaults_are_transformers():
    """Fields left out take `GptOssConfig`'s defaults: layers alternating from a sliding one,
    YaRN (factor 32 over 4096, untruncated) at theta 150000, the 7.0 clamp."""
    hf = transformers.GptOssConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                   num_local_experts=4, num_experts_per_tok=2)
    ours = arch_config_from_hf({k: v for k, v in GPT_OSS_20B.items()
                                if k in ("architectures", "vocab_size")}
                               | dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=32,
                                      num_local_experts=4, num_experts_per_tok=2))
    want = tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert ours.layer_windows == want == (128, 0, 128)
    rope = hf.rope_parameters
    assert ours.rope_theta == rope["rope_theta"] and ours.rope_scaling == RopeScaling(
        "yarn", factor=rope["factor"], beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"],
        truncate=rope["truncate"],
        original_max_position_embeddings=rope["original_max_position_embeddings"])
    assert (ours.swiglu_limit, ours.swiglu_alpha) == (hf.swiglu_limit, hf.swiglu_alpha)
    assert ours.rms_norm_eps == hf.rms_norm_eps and ours.qkv_bias == hf.attention_bias


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2),
     "unsupported layer_types entry 'chunked_attention'"),
    (dict(swiglu_limit=0.0), "swiglu_limit must be positive"),
    (dict(swiglu_alpha=-1.0), "swiglu_alpha must be positive"),
    (dict(sliding_window=0), "sliding_window=0 for GptOssForCausalLM"),
    (dict(num_local_experts=0), "num_local_experts=0"),
    (dict(num_experts_per_tok=40), "num_experts_per_tok=40 must be in 1..num_experts"),
])
def test_bad_configs_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        arch_config_from_hf({**GPT_OSS_20B, **change})


def test_expert_fields_need_experts():
    cfg = arch_config_from_hf(GPT_OSS_20B)
    for field, value in (("moe_bias", True), ("swiglu_limit", 7.0)):
        dense = dict(num_experts=0, num_experts_per_tok=0, moe_bias=False, swiglu_limit=None)
        with pytest.raises(ValueError, match=f"{field}=.* needs routed experts"):
            dataclasses.replace(cfg, **{**dense, field: value})


def test_clamped_swiglu_is_transformers():
    """`ClampedSwiGLU` on interleaved gate/up columns equals `GptOssExperts._apply_gate`,
    with values past the clamp on both sides."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf_cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2)
    gate_up = torch.randn(5, 12, generator=torch.Generator().manual_seed(0)) * 6
    want = GptOssExperts(hf_cfg)._apply_gate(gate_up).numpy()
    x = gate_up.numpy()
    got = glu(ClampedSwiGLU(1.702, 7.0), x[:, 0::2], x[:, 1::2])
    assert np.abs(x).max() > 7  # the clamp binds
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 directory, our model, transformers' dequantized logits, prompt)."""
    case = next(c for c in CASES if c.name == "gpt_oss")
    float_dir = str(tmp_path_factory.mktemp("gpt_oss_float"))
    build_hf(case, float_dir)
    directory = write_mxfp4(float_dir, str(tmp_path_factory.mktemp("gpt_oss_mx") / "m"))
    ids = prompt(TINY["vocab_size"])
    return directory, load_model(directory), hf_logits(dequantized_hf(directory), ids), ids


@pytest.mark.slow(reason="a model compile and transformers' MXFP4 load (~4.5 s)")
def test_mxfp4_experts_equal_transformers_dequantized(mxfp4):
    directory, model, ref, ids = mxfp4
    assert model.quant.name == "mxfp4" and model.quant.get("experts.down_proj").kind == "mxfp4"
    assert model.quant.get("q_proj") is None  # attention, router, head: float as stored
    down = model.params["layers"]["mlp"]["experts"]["down_proj"]
    assert down["qweight"].dtype == np.uint8 and down["qweight"].shape == (2, 4, 16, 64)
    assert down["e8m0_scales"].shape == (2, 4, 1, 64)  # [L, E, I / 32, H]
    ours = forward_logits(model, ids, page_size=4, chunks=(7, 9, 8))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_mxfp4_refusals(tmp_path):
    """`quant_method: "mxfp4"` is gpt-oss's own; float experts it names, and misshapen
    blocks, are refused naming the field or tensor."""
    case = next(c for c in CASES if c.name == "gpt_oss")
    float_dir = str(tmp_path / "float")
    build_hf(case, float_dir)
    directory = write_mxfp4(float_dir, str(tmp_path / "mx"))

    def keep_experts(qc):
        qc["modules_to_not_convert"] = ["model.layers.*.mlp.experts"]

    bad = checkpoint_variant(directory, tmp_path / "bad1", config=keep_experts)
    with pytest.raises(ValueError, match="modules_to_not_convert names"):
        load_model(bad)

    def cut(t):
        name = "model.layers.0.mlp.experts.down_proj_scales"
        t[name] = t[name][..., :0]

    bad = checkpoint_variant(directory, tmp_path / "bad2", tensors=cut)
    with pytest.raises(ValueError, match="down_proj_blocks"):
        load_model(bad)
    llama = str(tmp_path / "llama")
    build_hf(next(c for c in CASES if c.name == "llama_bias"), llama)
    set_quantization_config(llama, {"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is gpt-oss's"):
        load_model(llama)


@pytest.mark.parametrize("impl", ["loop", "ragged_dot"])  # the CPU's, and GPU/TPU's
def test_moe_layer_is_transformers(impl):
    """`MoEMLP` with gpt-oss's fields (router and expert biases, the clamp binding) equals
    transformers' `GptOssMLP` on its own weights, gate/up split from the interleaved stack,
    through either grouped matmul."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from models.linear import choose_methods
    from models.moe import MoEMLP

    hf_cfg = transformers.GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=4,
                                       num_experts_per_tok=2, swiglu_limit=1.5)
    torch.manual_seed(0)
    mlp = GptOssMLP(hf_cfg).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    x = torch.randn(40, 16)
    with torch.no_grad():
        want = mlp(x[None])[0][0].numpy()
    cfg = arch_config_from_hf({**GPT_OSS_20B, **hf_cfg.to_dict(), "architectures": ARCH,
                               "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    methods = dataclasses.replace(choose_methods(cfg), grouped=impl)
    t = {k: v.detach().numpy() for k, v in mlp.state_dict().items()}
    gate_up, gate_up_bias = t["experts.gate_up_proj"], t["experts.gate_up_proj_bias"]
    params = {"gate": {"kernel": t["router.weight"].T, "bias": t["router.bias"]},
              "experts": {"gate_proj": gate_up[..., 0::2], "up_proj": gate_up[..., 1::2],
                          "down_proj": t["experts.down_proj"],
                          "gate_bias": gate_up_bias[:, 0::2], "up_bias": gate_up_bias[:, 1::2],
                          "down_bias": t["experts.down_proj_bias"]}}
    params = jax.tree_util.tree_map(jnp.asarray, params)  # device arrays, as served
    got = MoEMLP(cfg, np.float32, methods).apply({"params": params}, x.numpy())
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

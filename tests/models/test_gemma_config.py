"""Gemma 2/3 configs and checkpoints: layer patterns and rotary bases parsed as transformers
reads them, unsupported fields rejected by name, a Gemma 3 ForConditionalGeneration
checkpoint's language model, and the orbax round trip."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from models.loaders import convert, load_model
from models.registry import arch_config_from_hf
from models.rope import RopeScaling
from tests.models.helpers import forward_logits, hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=16, sliding_window=5)


def _hf_dict(config_cls: str, arch: str, **fields) -> dict:
    """A config dict as transformers writes it to config.json."""
    d = getattr(transformers, config_cls)(**{**TEXT, **fields}).to_dict()
    return {**d, "architectures": [arch]}


def _windows(config) -> tuple[int, ...]:
    return tuple(config.sliding_window if t == "sliding_attention" else 0
                 for t in config.layer_types)


@pytest.mark.parametrize("config_cls,arch,pattern", [
    ("Gemma2Config", "Gemma2ForCausalLM", None),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", None),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", 3),
])
def test_layer_pattern_without_layer_types(config_cls, arch, pattern):
    """Older configs give `sliding_window_pattern` (or nothing) instead of `layer_types`."""
    extra = {} if pattern is None else {"sliding_window_pattern": pattern}
    want = getattr(transformers, config_cls)(**{**TEXT, "num_hidden_layers": 7, **extra})
    d = _hf_dict(config_cls, arch, num_hidden_layers=7)
    del d["layer_types"]
    d.update(extra)
    assert arch_config_from_hf(d).layer_windows == _windows(want)


def test_gemma3_old_style_rope_fields():
    """`rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (local)."""
    d = {**TEXT, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 500000.0,
         "rope_local_base_freq": 2000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "hidden_activation": "gelu_pytorch_tanh"}
    cfg = arch_config_from_hf(d)
    assert (cfg.rope_theta, cfg.rope_scaling) == (500000.0, RopeScaling("linear", factor=8.0))
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (2000.0, RopeScaling())
    # And transformers agrees on what those fields mean.
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in d.items() if k != "architectures"})
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 500000.0
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 2000.0


@pytest.mark.parametrize("config_cls,arch,edit,message", [
    ("Gemma2Config", "Gemma2ForCausalLM",
     {"layer_types": ["sliding_attention", "chunked_attention", "full_attention",
                      "sliding_attention"]},
     "unsupported layer_types entry 'chunked_attention'"),
    ("Gemma2Config", "Gemma2ForCausalLM", {"query_pre_attn_scalar": None},
     "lacks query_pre_attn_scalar"),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", {"query_pre_attn_scalar": None},
     "lacks query_pre_attn_scalar"),
    ("Gemma2Config", "Gemma2ForCausalLM", {"hidden_activation": "gelu"},
     "unsupported hidden_activation 'gelu'; supported: silu, gelu_pytorch_tanh"),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", {"hidden_activation": "relu"},
     "unsupported hidden_activation 'relu'"),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0},
     "unsupported attn_logit_softcapping=50.0"),
    ("Gemma2Config", "Gemma2ForCausalLM", {"use_bidirectional_attention": True},
     "unsupported use_bidirectional_attention"),
    ("Gemma3TextConfig", "Gemma3ForCausalLM",
     {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 8.0},
                          "sliding_attention": {"rope_type": "default"}}},
     "unsupported rope type 'dynamic'"),
    ("Gemma3TextConfig", "Gemma3ForCausalLM",
     {"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "dynamic", "factor": 2.0}}},
     "unsupported rope type 'dynamic'"),
    ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": -1.0},
     "final_logit_softcap must be positive"),
    ("Gemma2Config", "Gemma2ForCausalLM", {"hidden_activation": None, "hidden_act": "silu"},
     "lacks hidden_activation"),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": None},
     "has sliding_attention layers but no sliding_window"),
])
def test_bad_config_is_an_error(config_cls, arch, edit, message):
    d = {**_hf_dict(config_cls, arch), **edit}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        arch_config_from_hf(d)


def test_bad_config_fails_load_model(tmp_path):
    """The error reaches `load_model` from a saved directory."""
    config = transformers.Gemma2Config(**TEXT)
    transformers.Gemma2ForCausalLM(config).save_pretrained(str(tmp_path))
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        d = json.load(f)
    del d["query_pre_attn_scalar"]
    with open(path, "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM config lacks query_pre_attn_scalar"):
        load_model(str(tmp_path))


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration (vision tower included) saved as HF does."""
    text = transformers.Gemma3TextConfig(**TEXT, sliding_window_pattern=2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    path = str(tmp_path_factory.mktemp("gemma3_mm"))
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def test_gemma3_multimodal_language_model(gemma3_multimodal, caplog):
    """The language model of a ForConditionalGeneration checkpoint loads (the vision tower
    is ignored, with a log line) and matches transformers' text-only forward."""
    hf, path = gemma3_multimodal
    with caplog.at_level("INFO", logger="models.registry"):
        model = load_model(path, "float32")
    assert "vision tower is ignored" in caplog.text
    assert model.cfg.architecture == "Gemma3ForConditionalGeneration"
    assert model.cfg.layer_windows == (5, 0, 5, 0) and model.cfg.qk_norm
    ids = np.random.default_rng(0).integers(0, 160, 20).tolist()
    np.testing.assert_allclose(forward_logits(model, ids, page_size=4), hf_logits(hf, ids),
                               rtol=0, atol=1e-4)


def test_multimodal_transformers5_tensor_names(gemma3_multimodal, tmp_path):
    """The same checkpoint under the names transformers 5 gives its modules
    (`model.language_model.*`) loads the same weights."""
    from safetensors.numpy import load_file, save_file

    _, path = gemma3_multimodal
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {k.replace("language_model.model.", "model.language_model.", 1): v
               for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    want, got = load_model(path).params, load_model(str(tmp_path)).params
    for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), jax.tree_util.keystr(kp))


def test_multimodal_final_soft_cap_is_an_error(gemma3_multimodal):
    _, path = gemma3_multimodal
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    d["text_config"]["final_logit_softcapping"] = 30.0
    with pytest.raises(ValueError, match=r"unsupported text_config.final_logit_softcapping=30"):
        arch_config_from_hf(d)


def test_gemma_orbax_round_trip(gemma3_multimodal, tmp_path):
    """A Gemma checkpoint converted to orbax keeps its config (local rotary included) and
    its logits."""
    _, path = gemma3_multimodal
    src = convert(path, str(tmp_path / "ckpt"))
    back = load_model(str(tmp_path / "ckpt"))
    assert back.cfg == src.cfg
    ids = list(range(3, 23))
    np.testing.assert_array_equal(forward_logits(back, ids, page_size=4),
                                  forward_logits(src, ids, page_size=4))

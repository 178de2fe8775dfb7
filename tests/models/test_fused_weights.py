"""Phi-3's fused `qkv_proj` / `gate_up_proj` tensors: split at load into the decoder's
q/k/v and gate/up weights exactly as transformers splits them, and errors that name the
fused tensor."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest

from models.loaders import load_model
from models.loaders.hf_names import SplitFused
from models.registry import arch_config_from_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, eos_token_id=2)
QKV = "model.layers.1.self_attn.qkv_proj.weight"


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    """A tiny random Phi-3 saved by transformers (heads of 8: q 32 rows, k and v 16)."""
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**CONFIG)).eval()
    path = str(tmp_path_factory.mktemp("phi3"))
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def test_split_matches_transformers_modules(phi3_dir):
    """Each split kernel is the fused weight's slice transformers uses for it (`qkv[...,
    :query_pos]` ...; `gate_up.chunk(2)`: gate first)."""
    hf, path = phi3_dir
    model = load_model(path)
    layers = model.params["layers"]
    for i, layer in enumerate(hf.model.layers):
        qkv = layer.self_attn.qkv_proj.weight.detach().numpy()
        gate_up = layer.mlp.gate_up_proj.weight.detach().numpy()
        pieces = {"q_proj": qkv[:32], "k_proj": qkv[32:48], "v_proj": qkv[48:]}
        for name, want in pieces.items():
            got = np.asarray(layers["self_attn"][name]["kernel"][i]).T
            np.testing.assert_array_equal(got, want, err_msg=name)
        np.testing.assert_array_equal(np.asarray(layers["mlp"]["gate_proj"]["kernel"][i]).T,
                                      gate_up[:40])
        np.testing.assert_array_equal(np.asarray(layers["mlp"]["up_proj"]["kernel"][i]).T,
                                      gate_up[40:])


class _Dict:
    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name):
        return self.tensors[name]

    def where(self, name):
        return "dict.safetensors"

    def names(self):
        return list(self.tensors)


def test_unfused_tensor_wins_and_others_pass_through():
    cfg = arch_config_from_hf({**transformers.Phi3Config(**CONFIG).to_dict(),
                               "architectures": ["Phi3ForCausalLM"]})
    fused = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    own = np.ones((32, 32), np.float32)
    source = SplitFused(_Dict({QKV: fused, "model.layers.1.self_attn.q_proj.weight": own,
                               "model.norm.weight": np.ones(32)}), cfg)
    assert source.get("model.layers.1.self_attn.q_proj.weight") is own
    np.testing.assert_array_equal(source.get("model.layers.1.self_attn.v_proj.weight"),
                                  fused[48:])
    assert source.get("model.norm.weight").shape == (32,)
    with pytest.raises(KeyError):
        source.get("model.layers.0.self_attn.k_proj.weight")
    assert "nor is the fused 'model.layers.0.self_attn.qkv_proj.weight'" in source.where(
        "model.layers.0.self_attn.k_proj.weight")


def _rewrite(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors_numpy.load_file(file)
    edit(tensors)
    safetensors_numpy.save_file(tensors, file, metadata={"format": "pt"})
    return file


def test_fused_tensor_with_wrong_rows_names_it(phi3_dir, tmp_path):
    _, src = phi3_dir
    path = shutil.copytree(src, str(tmp_path / "m"))
    file = _rewrite(path, lambda t: t.update({QKV: t[QKV][:60]}))
    with pytest.raises(ValueError, match=re.escape(
            f"tensor {QKV!r} in {file} has 60 rows, expected 32 + 16 + 16 = 64 for "
            "Phi3ForCausalLM")):
        load_model(path)


def test_missing_fused_tensor_names_both(phi3_dir, tmp_path):
    _, src = phi3_dir
    path = shutil.copytree(src, str(tmp_path / "m"))
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    _rewrite(path, lambda t: t.pop(gate_up))
    with pytest.raises(ValueError, match=re.escape(
            "'model.layers.0.mlp.gate_proj.weight' is missing from the safetensors files of "
            f"{path} (nor is the fused {gate_up!r} there)")):
        load_model(path)

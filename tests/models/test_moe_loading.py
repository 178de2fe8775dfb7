"""Loading mixture-of-experts checkpoints: a Qwen2-MoE (shared expert) through orbax from
its serving form, and with int8 weights (attention, shared expert and the routed expert
stacks quantized), against the float model's logits; a Qwen2-MoE mixing sparse and dense
layers (`models.mixed`) through orbax and int8 the same way."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models.linear import STACKS, serving_form
from models.loaders import load_model
from models.loaders.orbax_ckpt import save_checkpoint
from tests.models.helpers import forward_logits

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.models.test_numerics import CASES, PAGE_SIZE, build_hf, prompt  # noqa: E402


def _built(tmp_path_factory, case_name: str, seed: int):
    """(HF directory, the float model, a prompt, its logits) of numerics case `case_name`."""
    case = next(c for c in CASES if c.name == case_name)
    path = str(tmp_path_factory.mktemp(case_name))
    build_hf(case, path, seed=seed)
    model = load_model(path, "float32")
    ids = prompt(model.cfg.vocab_size, seed=seed)
    return path, model, ids, forward_logits(model, ids, page_size=PAGE_SIZE)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """(HF directory, the float model, a prompt, its logits)."""
    return _built(tmp_path_factory, "qwen2_moe_shared", seed=5)


def test_orbax_round_trip_from_the_serving_form(qwen2_moe, tmp_path):
    path, model, ids, ref = qwen2_moe
    served = serving_form(model, whole_experts=True)
    assert STACKS in served.params
    dst = str(tmp_path / "ckpt")
    save_checkpoint(dst, served.cfg, served.params, "float32", None)
    restored = load_model(dst, "float32")
    assert restored.params["layers"]["mlp"]["experts"]["down_proj"].shape == (2, 4, 32, 64)
    np.testing.assert_array_equal(forward_logits(restored, ids, page_size=PAGE_SIZE), ref)


def test_int8_quantizes_the_routed_experts_too(qwen2_moe, tmp_path):
    """int8 weights everywhere (attention, shared expert, the routed expert stacks with
    their [L, E] axes) give logits close to the float model's, and survive an orbax round
    trip stored quantized."""
    path, model, ids, ref = qwen2_moe
    q = load_model(path, "float32", quantization="int8")
    mlp = q.params["layers"]["mlp"]
    assert "qweight" in mlp["shared_expert"]["gate_proj"]
    assert "qweight" in q.params["layers"]["self_attn"]["q_proj"]
    assert mlp["experts"]["gate_proj"]["qweight"].shape == (2, 4, 64, 32)
    assert mlp["experts"]["down_proj"]["qweight"].dtype == np.int8
    ours = forward_logits(q, ids, page_size=PAGE_SIZE)
    err = np.abs(ours - ref)
    # Tolerance: per-channel int8 moves each weight by at most half a step (max|w| / 254),
    # about 0.4% of the largest weight; through two layers that held the median logit
    # error under 2% of the largest logit. An error that flips a token's top-k experts
    # jumps its logits, so the maximum is not bounded, and the argmax agrees on most rows.
    assert err.max() > 0 and np.median(err) < 0.02 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    dst = str(tmp_path / "int8")
    save_checkpoint(dst, q.cfg, q.params, "float32", None, quant=q.quant)
    restored = load_model(dst, "float32")
    assert restored.quant == q.quant
    for got, want in zip(jax.tree_util.tree_leaves(restored.params),
                         jax.tree_util.tree_leaves(q.params), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert jax.tree_util.tree_structure(restored.params) == \
        jax.tree_util.tree_structure(q.params)


def test_a_missing_expert_tensor_is_named(qwen2_moe, tmp_path):
    """One expert's tensor absent: the error names it and its file."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path = qwen2_moe[0]
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(str(broken), "float32")


@pytest.fixture(scope="module")
def qwen2_moe_mixed(tmp_path_factory):
    """(HF directory, the float model, a prompt, its logits) of a Qwen2-MoE whose last
    layer is dense."""
    return _built(tmp_path_factory, "qwen2_moe_mixed", seed=6)


def test_mixed_layers_orbax_round_trip(qwen2_moe_mixed, tmp_path):
    """The sparse [L_sparse, ...] and dense [L_dense, ...] stacks are saved and restored
    as they are (the served form is the loaded one: `whole_experts` moves nothing)."""
    path, model, ids, ref = qwen2_moe_mixed
    served = serving_form(model, whole_experts=True)
    assert STACKS not in served.params and not served.methods.whole_experts
    dst = str(tmp_path / "ckpt")
    save_checkpoint(dst, model.cfg, model.params, "float32", None)
    restored = load_model(dst, "float32")
    assert restored.cfg.dense_layers == (2,)
    layers = restored.params["layers"]
    assert layers["mlp"]["experts"]["gate_proj"].shape == (2, 4, 64, 32)
    assert layers["mlp"]["shared_expert"]["up_proj"]["kernel"].shape == (2, 64, 48)
    assert layers["dense_mlp"]["down_proj"]["kernel"].shape == (1, 96, 64)
    np.testing.assert_array_equal(forward_logits(restored, ids, page_size=PAGE_SIZE), ref)


def test_a_missing_dense_layer_tensor_is_named(qwen2_moe_mixed, tmp_path):
    """The dense layer's MLP is read under its HF name (`model.layers.2.mlp.*`)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(qwen2_moe_mixed[0], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    assert "model.layers.2.mlp.experts.0.up_proj.weight" not in tensors
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(str(broken), "float32")


@pytest.mark.slow  # int8 through the mixed layers: both stacks' quantized leaves
def test_mixed_layers_int8(qwen2_moe_mixed):
    path, model, ids, ref = qwen2_moe_mixed
    q = load_model(path, "float32", quantization="int8")
    layers = q.params["layers"]
    assert layers["dense_mlp"]["gate_proj"]["qweight"].shape == (1, 64, 96)
    assert "qweight" in layers["mlp"]["shared_expert"]["gate_proj"]
    assert layers["mlp"]["experts"]["gate_proj"]["qweight"].shape == (2, 4, 64, 32)
    ours = forward_logits(q, ids, page_size=PAGE_SIZE)
    err = np.abs(ours - ref)
    assert err.max() > 0 and np.median(err) < 0.02 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


@pytest.mark.slow  # a draft-model helper (`jaxserve bench --draft-layers`)
@pytest.mark.parametrize("name,keep,dense", [
    ("qwen3_moe_sparse_step", 3, (0, 2)),  # still mixed
    ("qwen3_moe_sparse_step", 1, None),  # layer 0 alone: a dense model
    ("qwen2_moe_mixed", 2, ()),  # layers 0-1: all sparse
])
def test_truncated_mixed_model_matches_transformers_first_layers(name, keep, dense, tmp_path):
    """`truncate_layers` of a mixed model keeps each stack's first layers: the logits of
    transformers' model cut to the same layers."""
    import torch

    from jaxserve.spec_decode.draft import truncate_layers
    from tests.models.helpers import hf_logits

    case = next(c for c in CASES if c.name == name)
    hf = build_hf(case, str(tmp_path), seed=7)
    draft = truncate_layers(load_model(str(tmp_path), "float32"), keep)
    if dense is None:
        assert not draft.cfg.is_moe and "dense_mlp" not in draft.params["layers"]
    else:
        assert draft.cfg.dense_layers == dense and draft.cfg.is_moe
    hf.model.layers = torch.nn.ModuleList(hf.model.layers[:keep])
    hf.config.num_hidden_layers = keep
    ids = prompt(draft.cfg.vocab_size, seed=7)
    np.testing.assert_allclose(forward_logits(draft, ids, page_size=PAGE_SIZE),
                               hf_logits(hf, ids), rtol=0, atol=1e-4)

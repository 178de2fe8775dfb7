"""Loading mixture-of-experts checkpoints: a Qwen2-MoE (shared expert) through orbax from
its serving form, and with int8 weights (attention, shared expert and the routed expert
stacks quantized), against the float model's logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models.loaders import load_model
from models.loaders.orbax_ckpt import save_checkpoint
from models.packed import COLLECTION, broadcast_experts
from tests.models.helpers import forward_logits

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.models.test_numerics import CASES, PAGE_SIZE, build_hf, prompt  # noqa: E402


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """(HF directory, the float model, a prompt, its logits)."""
    case = next(c for c in CASES if c.name == "qwen2_moe_shared")
    path = str(tmp_path_factory.mktemp("qwen2_moe"))
    build_hf(case, path, seed=5)
    model = load_model(path, "float32")
    ids = prompt(model.cfg.vocab_size, seed=5)
    return path, model, ids, forward_logits(model, ids, page_size=PAGE_SIZE)


def test_orbax_round_trip_from_the_serving_form(qwen2_moe, tmp_path):
    path, model, ids, ref = qwen2_moe
    served = broadcast_experts(model)
    assert COLLECTION in served.params
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

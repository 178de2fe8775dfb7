"""GPTQ and AWQ checkpoints read as they are (`models.loaders.quant_formats`): tiny models
packed by the test's own writers (`int_packers`, from each format's definition) give
transformers' logits on the dequantized weights, keep their bytes, and bad files are
refused naming the tensor and the field."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from models.loaders import load_model
from tests.models.helpers import forward_logits
from tests.models.int_packers import awq_tensors, gptq_tensors, write_quantized

# K = 128 or 256 everywhere: every group size (32, 64, 128, channel-wise) divides it.
LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, initializer_range=0.05, tie_word_embeddings=False)
IDS = np.random.default_rng(0).integers(0, 128, 12).tolist()


def _hf_logits(hf, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def _gptq(tmp, bits, group, sym, fmt="gptq", **extra):
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
          "desc_act": False, "checkpoint_format": fmt, **extra}
    return write_quantized(str(tmp), LLAMA, qc,
                           lambda q, z, s: gptq_tensors(q, z, s, bits, fmt == "gptq"),
                           bits, group, sym, min_zero=1 if fmt == "gptq" else 0)


def _awq(tmp, group):
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
          "version": "gemm"}
    return write_quantized(str(tmp), LLAMA, qc, awq_tensors, 4, group, sym=False)


def _weight_bytes(directory) -> int:
    from safetensors.numpy import load_file

    return sum(a.nbytes for a in load_file(os.path.join(directory, "model.safetensors")).values())


def _device_bytes(model) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))


CASES = {  # id: (writer, served leaf kind)
    "gptq-4bit-g128-sym": (lambda t: _gptq(t, 4, 128, True), "q4"),
    "gptq-4bit-g32-asym": (lambda t: _gptq(t, 4, 32, False), "q4"),
    "gptq_v2-4bit-channel-asym": (lambda t: _gptq(t, 4, -1, False, "gptq_v2"), "q4"),
    "gptq-8bit-g64-sym": (lambda t: _gptq(t, 8, 64, True), "q8"),
    "awq-4bit-g128": (lambda t: _awq(t, 128), "q4"),
    "awq-4bit-g64": (lambda t: _awq(t, 64), "q4"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_on_the_dequantized_weights(case, tmp_path):
    pytest.importorskip("torch")
    write, kind = CASES[case]
    hf, _ = write(tmp_path)
    model = load_model(str(tmp_path))
    assert model.quant.name == case.split("-")[0].removesuffix("_v2")
    q = model.params["layers"]["self_attn"]["q_proj"]
    assert ("zeros" in q) == (kind == "q4") and "kernel" not in q
    ours = forward_logits(model, IDS)
    ref = _hf_logits(hf, IDS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # Device bytes within 10% of the checkpoint's.
    assert abs(_device_bytes(model) / _weight_bytes(tmp_path) - 1) < 0.10

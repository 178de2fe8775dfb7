"""A checkpoint's own quantization (`models.loaders.checkpoint_quant`): detection, the
plumbing from a format's reader to the served leaves, and the refusals."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from models.loaders import load_model
from models.loaders.checkpoint_quant import (
    CheckpointFormat,
    checkpoint_format,
    read_quantization_config,
    register,
)
from models.quant import QuantFormat, QuantPlan, dequantize_rows, quantize_rows
from tests.models.helpers import forward_logits, set_quantization_config

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PER_CHANNEL = QuantFormat("q8", 0)


@register("test-int8")
def _int8_format(qc: dict, path: str, cfg) -> CheckpointFormat:
    """A format written only by this test: each layer matmul as `weight` i8[N, K] and
    `weight_scale` f16[N, 1] (w = q * scale, per output channel)."""

    def reader(source, name):
        if not name.endswith(".weight") or name.rsplit(".", 2)[-2] not in LINEARS:
            raise KeyError(name)
        return {"qweight": source.get(name), "scales": source.get(name + "_scale")}

    return CheckpointFormat("test-int8", QuantPlan(tuple(
        (m, PER_CHANNEL) for m in LINEARS), "test-int8"), reader)


def _write(directory: str, quant_config: dict | None) -> tuple[str, dict]:
    """A tiny Llama with its layer matmuls stored in the test format; (its directory, the
    dequantized float tensors)."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY))
    hf.save_pretrained(directory, safe_serialization=True)
    tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    dense = dict(tensors)
    for name, w in list(tensors.items()):
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            rows = quantize_rows(PER_CHANNEL, w)
            tensors[name], tensors[name + "_scale"] = rows["qweight"], rows["scales"]
            dense[name] = dequantize_rows(PER_CHANNEL, rows)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    set_quantization_config(directory, quant_config)
    return directory, dense


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return _write(str(tmp_path_factory.mktemp("int8")), {"quant_method": "test-int8"})


def test_a_checkpoints_own_format_is_served_as_stored(quantized, tmp_path):
    directory, dense = quantized
    model = load_model(directory)
    assert model.quant.name == "test-int8"
    q = model.params["layers"]["self_attn"]["q_proj"]
    assert q["qweight"].dtype == np.int8 and q["qweight"].shape == (2, 64, 64)
    assert load_model(directory, quantization="auto").quant.name == "test-int8"
    # The oracle: the same model with the dequantized weights as float32.
    from safetensors.numpy import save_file

    ref_dir = str(tmp_path / "dense")
    os.makedirs(ref_dir)
    with open(os.path.join(directory, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    with open(os.path.join(ref_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(dense, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], 12).tolist()
    np.testing.assert_allclose(forward_logits(model, ids), forward_logits(load_model(ref_dir), ids),
                               rtol=0, atol=1e-4)


def test_another_quantization_is_refused_naming_both(quantized):
    with pytest.raises(ValueError, match=r"quantization='int8'.*stores its weights as "
                                         r"'test-int8'"):
        load_model(quantized[0], quantization="int8")


def test_unknown_quant_method_names_it(quantized, tmp_path):
    directory = str(tmp_path / "m")
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"quantization_config": {"quant_method": "bitsandbytes"}}, f)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        checkpoint_format(directory, None)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"quantization_config": ["gptq"]}, f)
    with pytest.raises(ValueError, match="quantization_config must be a JSON object"):
        read_quantization_config(directory)


def test_an_older_gptq_file_is_read_from_quantize_config(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({}, f)
    with open(tmp_path / "quantize_config.json", "w") as f:
        json.dump({"bits": 4, "group_size": 128}, f)
    assert read_quantization_config(str(tmp_path)) == {"quant_method": "gptq", "bits": 4,
                                                        "group_size": 128}

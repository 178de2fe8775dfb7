"""GPTQ and AWQ checkpoints read as they are (`models.loaders.quant_formats`): tiny models
packed by the test's own writers (`int_packers`, from each format's definition) give
transformers' logits on the dequantized weights, keep their bytes, and bad files are
refused naming the tensor and the field."""

from __future__ import annotations

import os

import numpy as np
import pytest

from models.linear import serving_form, standard_params
from models.linear.registry import can_panel
from models.loaders import load_model
from tests.models.helpers import (
    QUANT_IDS,
    QUANT_LLAMA,
    QUANT_QWEN3_MOE,
    checkpoint_variant,
    forward_logits,
    hf_logits,
)
from tests.models.int_packers import awq_tensors, gptq_tensors, write_quantized


def _gptq(tmp, bits, group, sym, fmt="gptq", **extra):
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
          "desc_act": False, "checkpoint_format": fmt, **extra}
    return write_quantized(str(tmp), QUANT_LLAMA, qc,
                           lambda q, z, s: gptq_tensors(q, z, s, bits, fmt == "gptq"),
                           bits, group, sym, min_zero=1 if fmt == "gptq" else 0)


def _awq(tmp, group, config=QUANT_LLAMA):
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
          "version": "gemm"}
    return write_quantized(str(tmp), config, qc, awq_tensors, 4, group, sym=False)


def _weight_bytes(directory) -> int:
    from safetensors.numpy import load_file

    return sum(a.nbytes for a in load_file(os.path.join(directory, "model.safetensors")).values())


def _device_bytes(model) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))


CASES = {  # id: (writer, served leaf kind)
    "gptq-4bit-g128-sym": (lambda t: _gptq(t, 4, 128, True), "q4"),
    "gptq-4bit-g32-asym": (lambda t: _gptq(t, 4, 32, False), "q4"),
    "gptq-4bit-g32-sym": (lambda t: _gptq(t, 4, 32, True), "q4"),
    "gptq_v2-4bit-channel-asym": (lambda t: _gptq(t, 4, -1, False, "gptq_v2"), "q4"),
    "gptq-8bit-g64-sym": (lambda t: _gptq(t, 8, 64, True), "q8"),
    "awq-4bit-g128": (lambda t: _awq(t, 128), "q4"),
    "awq-4bit-g64": (lambda t: _awq(t, 64), "q4"),
    "awq-4bit-g128-qwen3moe": (lambda t: _awq(t, 128, QUANT_QWEN3_MOE), "q4"),
}


# NOTE: group sizes another default case has in the same format and symmetry run in the slow
# tier: GPTQ 4-bit symmetric in groups of 32 (groups of 128 and asymmetric groups of 32 stay)
# and AWQ in groups of 64 (AWQ's groups of 128 and GPTQ's groups of 64 stay).
SLOW_CASES = ("gptq-4bit-g32-sym", "awq-4bit-g64")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[pytest.mark.slow(reason="a group size another case has")]
                 if c in SLOW_CASES else []) for c in CASES])
def test_logits_equal_transformers_on_the_dequantized_weights(case, tmp_path):
    pytest.importorskip("torch")
    write, kind = CASES[case]
    hf, _ = write(tmp_path)
    model = load_model(str(tmp_path))
    assert model.quant.name == case.split("-")[0].removesuffix("_v2")
    q = model.params["layers"]["self_attn"]["q_proj"]
    assert ("zeros" in q) == (kind == "q4") and "kernel" not in q
    if "moe" in case:  # the routed experts' stacks stay quantized: [L, E, K / 2, N]
        assert model.params["layers"]["mlp"]["experts"]["down_proj"]["qweight"].shape == (
            2, 4, 64, 128)
    ours = forward_logits(model, QUANT_IDS)
    ref = hf_logits(hf, QUANT_IDS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # Device bytes within 10% of the checkpoint's (float32 zeros of an asymmetric group of
    # 32 add 19% to its quantized tensors: diluted here by the float embedding and head).
    assert abs(_device_bytes(model) / _weight_bytes(tmp_path) - 1) < 0.10
    # Dense models are read in place by the CPU kernel: groups of 32-128 or per channel as
    # the checkpoint has them, float32 zeros (AWQ, asymmetric GPTQ) included.
    assert can_panel(model.cfg, model.quant, model.dtype, "cpu") == ("moe" not in case)
    if case in ("gptq-4bit-g128-sym", "awq-4bit-g128"):
        panel = serving_form(model, backend="cpu", panels=True)
        np.testing.assert_allclose(forward_logits(panel, QUANT_IDS), ref, rtol=0, atol=2e-5)
        back = standard_params(panel.params, panel.cfg, panel.quant)  # as loaded
        for name in ("qweight", "scales", "zeros"):
            np.testing.assert_array_equal(back["layers"]["self_attn"]["q_proj"][name],
                                          q[name])


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp("gptq")
    _gptq(directory, 4, 32, False)
    return str(directory)


Q = "model.layers.1.self_attn.q_proj"
BAD_FILES = {  # id: (tensor edit, config edit, message)
    "missing-scales": (lambda t: t.pop(f"{Q}.scales"), None, f"'{Q}': scales is missing"),
    "missing-qzeros": (lambda t: t.pop(f"{Q}.qzeros"), None, f"'{Q}': qzeros is missing"),
    "scales-shape": (lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"][:2]}), None,
                     rf"'{Q}': scales has shape \(2, 128\), expected \(4, 128\)"),
    "qzeros-shape": (lambda t: t.update({f"{Q}.qzeros": t[f"{Q}.qzeros"][:, :8]}), None,
                     rf"'{Q}': qzeros has shape \(4, 8\), expected \(4, 16\)"),
    "qweight-dtype": (lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].astype(np.float32)}),
                      None, rf"'{Q}': qweight must be int32"),
    "qweight-shape": (lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"][:, :64]}), None,
                      rf"'{Q}': scales has shape \(4, 128\), expected \(4, 64\)"),
    "act-order": (lambda t: t.update({f"{Q}.g_idx": t[f"{Q}.g_idx"][::-1].copy()}), None,
                  rf"'{Q}': g_idx orders groups by activation, but the config says"),
    "bits": (None, lambda qc: qc.update(bits=3), r"quantization_config: bits=3 is not supported"),
    "group": (None, lambda qc: qc.update(group_size=48), r"group_size=48 is not supported"),
    "asym-8bit": (None, lambda qc: qc.update(bits=8), r"asymmetric 8-bit weights \(sym=false\)"),
    "format": (None, lambda qc: qc.update(checkpoint_format="marlin"),
               r"checkpoint_format 'marlin' is not supported"),
    "lm-head": (None, lambda qc: qc.update(lm_head=True), r"lm_head=true"),
    "awq-version": (None, lambda qc: qc.update(quant_method="awq", version="gemv"),
                    r"version 'gemv' is not supported"),
    "awq-bits": (None, lambda qc: qc.update(quant_method="awq", bits=8),
                 r"bits=8 is not supported for AWQ"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_refused_naming_the_tensor_and_field(case, gptq_dir, tmp_path):
    tensors, config, message = BAD_FILES[case]
    with pytest.raises(ValueError, match=message):
        load_model(checkpoint_variant(gptq_dir, tmp_path / "m", tensors, config))

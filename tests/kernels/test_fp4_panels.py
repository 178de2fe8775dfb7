"""MXFP4 and NVFP4 codes read in place by the `cpu` backend's quantized kernel
(`pallas_kernels/cpu_ffi/qgemm_fp4.h`, the panels of `models/linear/panels.py`) against the
jnp reference (`pallas_kernels/fp4_matmul/reference.py`), and a compressed-tensors FP4
checkpoint served on the panels against transformers."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.config import ArchConfig
from models.linear import STACKS, serving_form, standard_params
from models.linear.panels import PanelLinear, plan_supported
from models.quant import QuantFormat, uniform_plan
from pallas_kernels.cpu_ffi import qgemm
from pallas_kernels.fp4_matmul.reference import fp4_matmul_reference
from pallas_kernels.quant_matmul.reference import int8_activations

pytestmark = pytest.mark.skipif(not qgemm.available(),
                                reason="needs a C++ compiler, x86-64 AVX2/F16C and the CPU")

K, N = 128, 100  # 100 columns: three units, the last one padded


def _fp4_leaves(kind: str, rng) -> dict:
    """Two layers of random FP4 leaves [2, ., N]: every code byte (layer 0's first 256),
    and per column scales of one magnitude (MXFP4: exponents 2^-107 .. 2^103 across the
    columns; NVFP4: E4M3 scales from its subnormal 2^-9 to 448, global scales 1e-3 and 40)."""
    codes = rng.integers(0, 256, (2, K // 2, N), dtype=np.uint8)
    codes[0].reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    if kind == "mxfp4":
        base = np.linspace(20, 230, N).astype(np.int64)  # a column's exponents, +- 3
        scales = np.clip(base + rng.integers(-3, 4, (2, K // 32, N)), 1, 254).astype(np.uint8)
        return {"qweight": codes, "e8m0_scales": scales}
    scales = rng.integers(1, 127, (2, K // 16, N), dtype=np.uint8)  # positive, finite E4M3
    scales[0, 0, :2] = (0x01, 0x7E)  # 2^-9 and 448
    return {"qweight": codes, "e4m3_scales": scales.view(ml_dtypes.float8_e4m3fn),
            "global_scale": np.asarray([1e-3, 40.0], np.float32).reshape(2, 1, 1)}


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_fp4_codes_match_the_reference(kind):
    rng = np.random.default_rng(len(kind))
    leaves = _fp4_leaves(kind, rng)
    fmt = QuantFormat(kind, qgemm.FP4_BLOCKS[kind])
    panels = PanelLinear(fmt).to_serving(leaves, stacked=True)
    assert panels["qweight"].shape == (2, 9, K // 2, 16)  # q4's panels, scales as stored
    assert panels[qgemm.LEAVES[kind][1]].dtype == leaves[qgemm.LEAVES[kind][1]].dtype
    back = PanelLinear(fmt).to_standard(panels, N, stacked=True)
    for name, leaf in leaves.items():
        np.testing.assert_array_equal(np.asarray(back[name]).view(np.uint8),
                                      np.asarray(leaf).view(np.uint8), err_msg=name)
    x = rng.standard_normal((13, K)).astype(np.float32)
    xq, xr, xd = int8_activations(jnp.asarray(x))  # what the dot path multiplies (< 12 rows)
    split = (xq + xr / 254.0) * jnp.repeat(xd, 32, axis=1)
    fn = jax.jit(lambda x, i, r: qgemm.stacked_qgemm(x, panels, kind, i, N, r))
    for layer in range(2):
        w = {m: jnp.asarray(a[layer]) for m, a in leaves.items()}
        exact = np.asarray(fp4_matmul_reference(jnp.asarray(x), w, kind))
        near = np.asarray(fp4_matmul_reference(split, w, kind))
        size = np.abs(exact).max(axis=0)  # per column: MXFP4's columns span 2^210
        assert np.isfinite(size).all() and (size > 0).all()
        for rows in (1, 3, 13):  # one row, a remainder tile, the staged path
            got = np.asarray(fn(x[:rows], layer, rows + 2))  # rows + 2: all real
            want = exact[:rows] if rows >= qgemm.STAGE_ROWS else near[:rows]
            np.testing.assert_allclose(got / size, want / size, rtol=0, atol=3e-6,
                                       err_msg=f"{kind} layer {layer}, {rows} rows")
            np.testing.assert_allclose(got / size, exact[:rows] / size, rtol=0, atol=2e-4)
        padded = np.asarray(fn(x[:5], layer, 2))  # a step's padding rows: zeros
        assert not padded[2:].any()
        np.testing.assert_array_equal(padded[:2], np.asarray(fn(x[:2], layer, 2)))


def test_fp4_bad_inputs_and_unsupported_plans():
    rng = np.random.default_rng(3)
    leaves = _fp4_leaves("nvfp4", rng)
    with pytest.raises(ValueError, match=r"nvfp4 global_scale \(2, 1\) must be \[layers, 1, 1\]"):
        qgemm.pack({**leaves, "global_scale": np.ones((2, 1), np.float32)}, "nvfp4")
    with pytest.raises(ValueError, match=r"lacks leaves \['global_scale'\]"):
        qgemm.pack({m: a for m, a in leaves.items() if m != "global_scale"}, "nvfp4")
    panels = qgemm.pack(leaves, "nvfp4")
    out = jax.ShapeDtypeStruct((1, 144), jnp.float32)
    call = jax.ffi.ffi_call(qgemm.TARGETS["nvfp4"], out)
    with pytest.raises(jax.errors.JaxRuntimeError, match="stacked_qgemm fp4: inconsistent"):
        jax.block_until_ready(call(np.ones((1, K), np.float32), panels["qweight"],
                                   panels["e4m3_scales"].astype(jnp.float16),
                                   panels["global_scale"], jnp.asarray(0, jnp.int32)))
    assert qgemm.supports("mxfp4", 64, 32) and qgemm.supports("nvfp4", 64, 16)
    assert not qgemm.supports("nvfp4", 48, 16) and not qgemm.supports("mxfp4", 64, 16)
    cfg = ArchConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64,
                     intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=16)
    mx = uniform_plan("compressed-tensors", QuantFormat("mxfp4", 32),
                      ("q_proj", "o_proj", "down_proj", "lm_head"))
    assert plan_supported(mx, cfg)
    # An input size of 48 (three NVFP4 blocks, not a whole 32-value kernel block) and a tied
    # FP4 embedding stay on XLA.
    assert not plan_supported(mx, dataclasses.replace(cfg, hidden_size=48))
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)
    assert not plan_supported(uniform_plan("ct", QuantFormat("nvfp4", 16)), tied)


@pytest.mark.parametrize("preset", ["mxfp4", "nvfp4"])
def test_a_compressed_tensors_fp4_checkpoint_serves_on_the_panels(preset, tmp_path):
    pytest.importorskip("compressed_tensors")
    from models.loaders import load_model
    from tests.models.ct_pack import write_ct
    from tests.models.fp4_pack import fp4_scheme
    from tests.models.helpers import QUANT_IDS, QUANT_LLAMA, forward_logits, hf_logits

    hf, _ = write_ct(str(tmp_path), QUANT_LLAMA, fp4_scheme(preset))
    loaded = load_model(str(tmp_path))
    model = serving_form(loaded, backend="cpu", panels=True)
    assert model.serving.panels and model.quant.get("down_proj").kind == preset
    stacks = model.params[STACKS]["layers"]["mlp"]["down_proj"]
    assert sorted(stacks) == sorted(qgemm.LEAVES[preset])
    ref = hf_logits(hf, QUANT_IDS)
    # The whole prompt (12 rows: the staged path), then decode-sized steps (the dot path).
    for chunks in (None, [8, 1, 3]):
        ours = forward_logits(model, QUANT_IDS, chunks=chunks)
        np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4, err_msg=str(chunks))
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    back = standard_params(model.params, model.cfg, model.quant)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(
        np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), back, loaded.params)

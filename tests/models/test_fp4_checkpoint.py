"""FP4 E2M1 checkpoints (MXFP4 and NVFP4, `models.loaders.quant_formats.fp4`) served as
stored: tiny models written by compressed-tensors' own compressor (`fp4_pack`) give
transformers' logits on its decompressed weights, dense layers and routed experts, with
their codes and scales kept in their stored dtypes; gpt-oss's expert layout against
transformers' own MXFP4 dequantizer; bad files refused naming the tensor and the field."""

from __future__ import annotations

import numpy as np
import pytest

from models.linear.fp4 import Fp4Linear
from models.linear.registry import choose_methods, stored_method
from models.loaders import load_model
from models.loaders.quant_formats.fp4 import compressed_tensors_fp4, gpt_oss_expert_leaves
from models.loaders.safetensors_dir import SafetensorsDir
from models.quant import QuantFormat, QuantPlan
from tests.models.helpers import (
    QUANT_IDS,
    QUANT_LLAMA,
    QUANT_QWEN3_MOE,
    checkpoint_variant,
    forward_logits,
    hf_logits,
)

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from tests.models.ct_pack import write_ct  # noqa: E402
from tests.models.fp4_pack import compress_fp4, fp4_scheme  # noqa: E402

MX, NV = QuantFormat("mxfp4", 32), QuantFormat("nvfp4", 16)
CASES = {  # id: (scheme preset, config, served format)
    "mxfp4-llama": ("mxfp4", QUANT_LLAMA, MX),
    "nvfp4-qwen3moe": ("nvfp4", QUANT_QWEN3_MOE, NV),
    "mxfp4-qwen3moe": ("mxfp4", QUANT_QWEN3_MOE, MX),
    "nvfp4-llama": ("nvfp4", QUANT_LLAMA, NV),
    "nvfp4-w4a4-llama": ("nvfp4-w4a4", QUANT_LLAMA, NV),  # FP4 activations served in float
    "mxfp4-w4a4-llama": ("mxfp4-w4a4", QUANT_LLAMA, MX),
}
# The default tier runs one case per kind (dense layers in MXFP4, expert stacks in NVFP4);
# the rest compile a model each.
DEFAULT = ("mxfp4-llama", "nvfp4-qwen3moe")


@pytest.fixture(scope="module", params=[
    c if c in DEFAULT else pytest.param(c, marks=pytest.mark.slow(reason="more FP4 schemes"))
    for c in CASES])
def served(request, tmp_path_factory):
    """(case, directory, our model, transformers' model on the decompressed weights, the
    checkpoint's tensors), one per case."""
    preset, config, _ = CASES[request.param]
    directory = str(tmp_path_factory.mktemp(request.param))
    hf, tensors = write_ct(directory, config, fp4_scheme(preset))
    return request.param, directory, load_model(directory), hf, tensors


def test_logits_equal_transformers_on_the_decompressed_weights(served):
    case, _, model, hf, tensors = served
    fmt = CASES[case][2]
    assert model.quant.name == "compressed-tensors" and model.quant.get("q_proj") == fmt
    assert model.quant.get("lm_head") is None
    assert isinstance(choose_methods(model.cfg, model.quant).linear("o_proj"), Fp4Linear)
    q = model.params["layers"]["self_attn"]["o_proj"]
    scale_dtype = "uint8" if fmt.kind == "mxfp4" else "float8_e4m3fn"
    scale_leaf = "e8m0_scales" if fmt.kind == "mxfp4" else "e4m3_scales"
    assert q["qweight"].dtype == np.uint8 and q["qweight"].shape == (2, 64, 128)  # [L, K/2, N]
    assert q[scale_leaf].dtype == np.dtype(scale_dtype)
    assert q[scale_leaf].shape == (2, 128 // fmt.block, 128)
    if "moe" in case:  # the routed experts stay FP4, the router float
        assert model.quant.get("experts.down_proj") == fmt
        experts = model.params["layers"]["mlp"]["experts"]
        assert experts["down_proj"]["qweight"].shape == (2, 4, 64, 128)  # [L, E, I/2, H]
        assert "qweight" not in model.params["layers"]["mlp"]["gate"]
    ours = forward_logits(model, QUANT_IDS)
    ref = hf_logits(hf, QUANT_IDS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-5)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # Device bytes within 10% of the checkpoint's (NVFP4: its global scales' 4 bytes more).
    on_disk = sum(t.numel() * t.element_size() for t in tensors.values())
    assert abs(model.weight_bytes / on_disk - 1) < 0.10


@pytest.mark.parametrize("preset", ["mxfp4", "nvfp4"])
def test_leaves_dequantize_to_the_decompressors_weights(preset, tmp_path):
    """One Linear read by `compressed_tensors_fp4` and dequantized by `Fp4Linear.dense`:
    compressed-tensors' float32 `dequantize` of its unpacked codes (NVFP4 to one float32
    rounding: the global scale is kept as its reciprocal), and its own `decompress`
    (bfloat16) exactly once rounded to bfloat16."""
    from compressed_tensors.compressors.base import BaseCompressor
    from safetensors.torch import save_file

    sch = fp4_scheme(preset)
    w = np.random.default_rng(1).normal(0, 0.05, (48, 96)).astype(np.float32)
    out, back = compress_fp4(w, sch)
    save_file({f"m.{k}": v for k, v in out.items()}, str(tmp_path / "model.safetensors"))
    fmt, reader = compressed_tensors_fp4(sch.format, sch.weights.model_dump(mode="json"))
    rows = reader(SafetensorsDir(str(tmp_path)), "m.weight")
    got = np.asarray(Fp4Linear(fmt).dense({k: v.T for k, v in rows.items()}, np.float32)).T
    np.testing.assert_allclose(got, back, rtol=2**-23, atol=0)
    decompressed = BaseCompressor.get_value_from_registry(sch.format).decompress(dict(out), sch)
    rounded = torch.from_numpy(np.ascontiguousarray(got)).to(torch.bfloat16)
    assert torch.equal(rounded, decompressed["weight"])
    assert stored_method(rows).fmt == fmt  # the leaves' names say their kind


def test_gpt_oss_experts_equal_transformers_dequantization():
    """gpt-oss's `*_blocks` u8[E, N, K/32, 16] and `*_scales` u8[E, N, K/32] read into the
    ``mxfp4`` stack equal transformers' `convert_moe_packed_tensors` (its CPU MXFP4
    dequantizer, [E, K, N])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)  # E=3, N=40, K=128
    scales = rng.integers(118, 134, (3, 40, 4), dtype=np.uint8)
    leaves = gpt_oss_expert_leaves(blocks, scales, "model.layers.0.mlp.experts.down_proj")
    assert leaves["qweight"].shape == (3, 64, 40) and leaves["e8m0_scales"].shape == (3, 4, 40)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()
    got = np.asarray(Fp4Linear(MX).dense(leaves, np.float32))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"'x': x_scales must be uint8 with 3 axes, got int32"):
        gpt_oss_expert_leaves(blocks, scales.astype(np.int32), "x")
    with pytest.raises(ValueError, match=r"'x': x_blocks \(for x_scales\) has shape "
                                         r"\(3, 40, 4, 16\), expected \(3, 40, 2, 16\)"):
        gpt_oss_expert_leaves(blocks, scales[..., :2], "x")


def test_tensor_parallel_splits_fp4_on_block_boundaries():
    """Row-parallel FP4 leaves split codes and block scales together (tp=2: 128 inputs,
    two shards of 64), the global scale whole; a split that would cut a block (an MLP
    width of 96 = three MXFP4 blocks over 2 devices) is refused naming the layer."""
    from jax.sharding import PartitionSpec as P

    from jaxserve.parallel.layouts import make_tensor_parallel
    from models.config import ArchConfig
    from models.model import abstract_params

    plan = QuantPlan((("o_proj", NV), ("down_proj", MX), ("q_proj", NV)), "compressed-tensors")
    cfg = ArchConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16)
    specs = make_tensor_parallel(cfg, 2).param_specs(abstract_params(cfg, "float32", plan))
    o = specs["layers"]["self_attn"]["o_proj"]
    axes = o["qweight"][-2]
    assert axes is not None and o["e4m3_scales"] == P(None, axes, None)
    assert o["global_scale"] == P()
    assert specs["layers"]["mlp"]["down_proj"]["e8m0_scales"] == P(None, axes, None)
    assert specs["layers"]["self_attn"]["q_proj"]["qweight"][-1] is not None  # column split
    bad = ArchConfig(**{**cfg.__dict__, "intermediate_size": 96})
    with pytest.raises(ValueError, match=r"layers/mlp/down_proj: an mxfp4 weight of 96 inputs "
                                         r"in blocks of 32 cannot be split 2 ways.*a shard of "
                                         r"48 inputs would cut a block"):
        make_tensor_parallel(bad, 2).param_specs(abstract_params(bad, "float32", plan))


def test_the_registry_and_the_formats_leaves():
    """The registry serves an FP4 plan with `Fp4Linear` (the Pallas kernel on the `pallas`
    backend, dense layers and expert stacks alike); a kind's block is fixed."""
    from models.config import ArchConfig
    from models.linear import ServingChoice

    cfg = ArchConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=64,
                     intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=16, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=64)
    plan = QuantPlan((("q_proj", MX), ("experts.down_proj", NV)), "compressed-tensors")
    methods = choose_methods(cfg, plan, choice=ServingChoice(backend="pallas"))
    assert methods.linear("q_proj") == Fp4Linear(MX, kernel="pallas")
    assert methods.expert("down_proj").fmt == NV
    assert NV.leaf_shapes(64, 8) == {"qweight": ((32, 8), "uint8"),
                                     "e4m3_scales": ((4, 8), "float8_e4m3fn"),
                                     "global_scale": ((1, 1), "float32")}
    assert QuantPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="mxfp4 block 16 must be 32"):
        QuantFormat("mxfp4", 16).leaf_shapes(64, 8)


Q = "model.layers.1.self_attn.q_proj"


def _group(qc, **args):
    qc["config_groups"]["group_0"]["weights"].update(args)


BAD_FILES = {  # id: (preset, tensor edit, config edit, message)
    "missing-scale": ("mxfp4", lambda t: t.pop(f"{Q}.weight_scale"), None,
                      f"'{Q}': weight_scale is missing"),
    "missing-global-scale": ("nvfp4", lambda t: t.pop(f"{Q}.weight_global_scale"), None,
                             f"'{Q}': weight_global_scale is missing"),
    "bad-global-scale": ("nvfp4", lambda t: t.update({f"{Q}.weight_global_scale":
                                                      torch.zeros(1)}), None,
                         f"'{Q}': weight_global_scale must be one positive float"),
    "packed-shape": ("mxfp4", lambda t: t.update({f"{Q}.weight_packed":
                                                  t[f"{Q}.weight_packed"][:, :48].contiguous()}),
                     None, rf"'{Q}': weight_packed \(for weight_scale's 4 blocks of 32\) has "
                           rf"shape \(128, 48\), expected \(128, 64\)"),
    "packed-dtype": ("nvfp4", lambda t: t.update({f"{Q}.weight_packed":
                                                  t[f"{Q}.weight_packed"].to(torch.int32)}),
                     None, rf"'{Q}': weight_packed must be uint8\[N, K / 2\]"),
    "scale-dtype": ("nvfp4", lambda t: t.update({f"{Q}.weight_scale":
                                                 t[f"{Q}.weight_scale"].float()}),
                    None, rf"'{Q}': weight_scale must be float8_e4m3fn\[N, K / 16\]"),
    "mx-group-size": ("mxfp4", None, lambda qc: _group(qc, group_size=16),
                      r"group_0.weights.group_size 16 must be 32 for mxfp4-pack-quantized"),
    "nv-group-size": ("nvfp4", None, lambda qc: _group(qc, group_size=32),
                      r"group_0.weights.group_size 32 must be 16 for nvfp4-pack-quantized"),
    "nv-strategy": ("nvfp4", None, lambda qc: _group(qc, strategy="group"),
                    r"weights.strategy 'group' is not supported for nvfp4-pack-quantized"),
    "asymmetric": ("mxfp4", None, lambda qc: _group(qc, symmetric=False),
                   r"group_0.weights.symmetric: FP4 weights must be symmetric"),
    "int-type": ("mxfp4", None, lambda qc: _group(qc, type="int"),
                 r"num_bits 4, type 'int' is not FP4"),
    "mx-scale-dtype": ("mxfp4", None, lambda qc: _group(qc, scale_dtype="torch.float16"),
                       r"scale_dtype 'torch.float16' is not supported for mxfp4"),
}


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    """A tiny Llama per kind for the refusal tests (loading fails before any compile)."""
    out = {}
    for preset in ("mxfp4", "nvfp4"):
        out[preset] = str(tmp_path_factory.mktemp(preset))
        write_ct(out[preset], QUANT_LLAMA, fp4_scheme(preset))
    return out


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_refused_naming_the_tensor_and_field(case, small_dirs, tmp_path):
    preset, tensors, config, message = BAD_FILES[case]
    with pytest.raises(ValueError, match=message):
        load_model(checkpoint_variant(small_dirs[preset], tmp_path / "m", tensors, config,
                                      lib="torch"))

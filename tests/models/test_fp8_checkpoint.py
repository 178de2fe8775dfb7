"""FP8 checkpoints (`quant_method: "fp8"`, `models.loaders.quant_formats.fp8`) served as
stored: block-wise (with edge blocks), per tensor, per channel (compressed-tensors), dense
layers and routed experts, against transformers on the dequantized weights."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from models.linear import serving_form
from models.linear.fp8 import Fp8Linear
from models.loaders import load_model
from models.loaders.quant_formats.fp8 import compressed_tensors_fp8
from models.loaders.safetensors_dir import SafetensorsDir, read_safetensors_header
from models.quant import QuantFormat, QuantPlan
from tests.models.fp8_pack import pack_fp8, unpack_fp8, write_dense_dir, write_fp8_dir
from tests.models.helpers import forward_logits, hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Qwen3 with SmolLM2's vocabulary; hidden 64 and intermediate 96: blocks of 32 divide every
# matmul (what transformers' FP8 dequantizer needs); intermediate 80 cuts the edge block.
QWEN3 = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.1)
BLOCK = [32, 32]
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": BLOCK}
IDS = [1, 504, 3000, 77, 12, 9001, 4, 260, 31, 7]


def _qwen3(seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**{**QWEN3, **kw}, attn_implementation="eager")
    return transformers.Qwen3ForCausalLM(cfg).float().eval()


def _dense_hf(directory: str, fp8_dir: str, dense: dict):
    """transformers' model of the dequantized weights: the oracle."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        write_dense_dir(directory, fp8_dir, dense), dtype=torch.float32,
        attn_implementation="eager").eval()


def _checkpoint_bytes(directory: str) -> int:
    header, _ = read_safetensors_header(os.path.join(directory, "model.safetensors"))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
               if k != "__metadata__")


def _check_against(model, hf, directory: str):
    """Teacher-forced greedy: transformers' greedy continuation of IDS, then our logits over
    it; every next token is our argmax too, and the logits agree to float32 tolerance."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([IDS]), max_new_tokens=6, do_sample=False,
                          min_new_tokens=6, pad_token_id=0)[0].tolist()
    ours = forward_logits(model, out)
    np.testing.assert_allclose(ours, hf_logits(hf, out), rtol=0, atol=2e-4)
    assert np.argmax(ours[len(IDS) - 1:-1], -1).tolist() == out[len(IDS):]
    assert abs(model.weight_bytes / _checkpoint_bytes(directory) - 1) < 0.10


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fp8_block"))
    hf = _qwen3()
    return directory, hf, write_fp8_dir(directory, hf, tuple(BLOCK), FP8)


def test_block_fp8_equals_transformers_dequantized(block_dir):
    directory, hf, dense = block_dir
    model = load_model(directory)
    assert model.quant.name == "fp8"
    q = model.params["layers"]["mlp"]["down_proj"]
    assert q["qweight"].dtype == np.dtype("float8_e4m3fn") and q["qweight"].shape == (2, 96, 64)
    assert q["block_scales"].shape == (2, 3, 2)  # [L, K / 32, N / 32]
    assert "qweight" not in model.params["lm_head"]  # the LM head and embedding stay float
    # transformers' own FP8 loader, dequantizing on the CPU, reads the file we wrote.
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    sd = ref.state_dict()
    method = Fp8Linear(QuantFormat("fp8", 32, block_n=32))
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(sd[name].numpy(), dense[name])
    leaves = {k: np.asarray(v[1]) for k, v in q.items()}
    np.testing.assert_array_equal(np.asarray(method.dense(leaves, np.float32)),
                                  sd["model.layers.1.mlp.down_proj.weight"].numpy().T)
    _check_against(model, ref.eval(), directory)


@pytest.mark.parametrize("block,extra", [
    ((32, 32), dict(intermediate_size=80)),  # edge blocks of 16 along N (gate/up), K (down)
    ("tensor", {}),
])
def test_edge_blocks_and_per_tensor_equal_the_dequantized_model(tmp_path, block, extra):
    hf = _qwen3(1, **extra)
    config = ({**FP8, "activation_scheme": "static"} if block == "tensor" else FP8)
    if block == "tensor":
        config = {k: v for k, v in config.items() if k != "weight_block_size"}
    directory = str(tmp_path / "fp8")
    dense = write_fp8_dir(directory, hf, block, config,
                          "_scale" if block == "tensor" else "_scale_inv")
    model = load_model(directory)
    scales = model.params["layers"]["mlp"]["gate_proj"]["block_scales"]
    assert scales.shape == ((2, 2, 3) if block != "tensor" else (2, 1, 1))
    hf_dense = _dense_hf(str(tmp_path / "dense"), directory, dense)
    _check_against(model, hf_dense, directory)
    if block == "tensor":  # the cpu backend's panels: the codes widened in registers
        panel = serving_form(model, backend="cpu", panels=True)
        assert panel.serving.panels
        np.testing.assert_allclose(forward_logits(panel, IDS), hf_logits(hf_dense, IDS),
                                   rtol=0, atol=2e-4)


def test_compressed_tensors_fp8_schemes_read_every_strategy(tmp_path):
    """`compressed_tensors_fp8` (for the compressed-tensors builder): per tensor, channel
    and block `weight_scale`, against the packer's inverse."""
    from safetensors.numpy import save_file

    w = np.random.default_rng(2).normal(size=(80, 48)).astype(np.float32)
    for strategy, block in (("tensor", "tensor"), ("channel", "channel"), ("block", (32, 16))):
        q, s = pack_fp8(w, block)
        save_file({"m.weight": q, "m.weight_scale": s}, str(tmp_path / "model.safetensors"))
        args = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                "dynamic": False, **({"block_structure": list(block)} if strategy == "block"
                                     else {})}
        fmt, reader = compressed_tensors_fp8(args)
        leaves = {k: v.T for k, v in reader(SafetensorsDir(str(tmp_path)), "m.weight").items()}
        got = Fp8Linear(fmt).dense(leaves, np.float32)
        np.testing.assert_array_equal(np.asarray(got).T, unpack_fp8(q, s, block))
    with pytest.raises(ValueError, match=r"weights.strategy 'group' is not supported"):
        compressed_tensors_fp8({**args, "strategy": "group"})
    with pytest.raises(ValueError, match="is not FP8"):
        compressed_tensors_fp8({**args, "type": "int"})


def test_moe_experts_in_fp8_equal_the_dequantized_model(tmp_path):
    torch.manual_seed(3)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=128, initializer_range=0.1, attn_implementation="eager")
    hf = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    directory = str(tmp_path / "fp8")
    dense = write_fp8_dir(directory, hf, (32, 32), FP8)
    model = load_model(directory)
    assert model.quant.get("experts.down_proj") == QuantFormat("fp8", 32, block_n=32)
    experts = model.params["layers"]["mlp"]["experts"]
    assert experts["down_proj"]["block_scales"].shape == (2, 4, 2, 2)  # [L, E, 48 / 32, 2]
    assert "qweight" not in model.params["layers"]["mlp"]["gate"]  # the router stays float
    _check_against(model, _dense_hf(str(tmp_path / "dense"), directory, dense), directory)


def _broken(src: str, dst: str, tensors=None, config=None) -> str:
    """A copy of checkpoint `src` with tensors replaced (None: removed) or config fields set."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensors:
        all_tensors = load_file(os.path.join(src, "model.safetensors"))
        for name, value in tensors.items():
            if value is None:
                del all_tensors[name]
            else:
                all_tensors[name] = torch.from_numpy(value)
        save_file(all_tensors, os.path.join(dst, "model.safetensors"))
    if config:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {**cfg["quantization_config"], **config}
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


V = "model.layers.1.self_attn.v_proj.weight"


@pytest.mark.parametrize("tensors,config,match", [
    ({V + "_scale_inv": None}, None, rf"{V}_scale_inv' is missing .*needs its 'scale_inv'"),
    ({V + "_scale_inv": np.ones((2, 1), np.float32)}, None,
     rf"{V}_scale_inv'.*float32\[2, 1\], expected float scales \[1, 2\].*weight_block_size"),
    ({V: np.zeros((32, 64), np.float32)}, None, rf"{V}'.*float32\[32, 64\].*float8_e4m3fn"),
    (None, {"fmt": "e5m2"}, r"quantization_config.fmt 'e5m2' is not supported"),
    (None, {"activation_scheme": "per_token"},
     r"quantization_config.activation_scheme 'per_token' is not supported"),
    (None, {"weight_block_size": [48, 32]}, r"weight_block_size \[48, 32\] must be two"),
    (None, {"modules_to_not_convert": ["model.layers.0.mlp.down_proj"]},
     r"modules_to_not_convert names 'model.layers.0.mlp.down_proj'"),
])
def test_bad_fp8_files_name_the_tensor_and_field(block_dir, tmp_path, tensors, config, match):
    directory = _broken(block_dir[0], str(tmp_path / "bad"), tensors, config)
    with pytest.raises(ValueError, match=match):
        load_model(directory)


def test_plan_round_trips_and_router_exclusions(block_dir, tmp_path):
    plan = QuantPlan((("q_proj", QuantFormat("fp8", 128, block_n=64)),), "fp8")
    assert QuantPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    directory = _broken(block_dir[0], str(tmp_path / "skip"),
                        config={"modules_to_not_convert": ["lm_head", "mlp.gate",
                                                           "model.norm"]})
    assert load_model(directory).quant.get("down_proj") == QuantFormat("fp8", 32, block_n=32)


def test_tensor_parallel_splits_fp8_on_block_boundaries():
    """Column- and row-parallel FP8 leaves split codes and scales together on block
    boundaries (tp=2: 64 / 2 = one block of 32 per device); a split that would cut a block
    (intermediate 96 = three blocks over 2 devices) is refused naming the layer."""
    from jax.sharding import PartitionSpec as P

    from jaxserve.parallel.sharding import make_tensor_parallel
    from models.config import ArchConfig
    from models.model import abstract_params

    fmt = QuantFormat("fp8", 32, block_n=32)
    plan = QuantPlan(tuple((m, fmt) for m in ("q_proj", "o_proj", "gate_proj")), "fp8")
    cfg = ArchConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=64,
                     intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16)
    specs = make_tensor_parallel(cfg, 2).param_specs(abstract_params(cfg, "float32", plan))
    attn = specs["layers"]["self_attn"]
    assert attn["q_proj"]["qweight"][-1] is not None and attn["q_proj"]["block_scales"][-1]
    assert attn["o_proj"]["qweight"][-2] is not None and attn["o_proj"]["block_scales"][-2]
    assert attn["o_proj"]["block_scales"] == P(None, attn["o_proj"]["qweight"][-2], None)
    bad = ArchConfig(**{**cfg.__dict__, "intermediate_size": 96})
    with pytest.raises(ValueError, match=r"layers/mlp/gate_proj: an FP8 weight \(2, 64, 96\)"
                                         r" in blocks of 32x32 cannot be split 2 ways.*"
                                         r"a shard of 48 would cut a block of 32"):
        make_tensor_parallel(bad, 2).param_specs(abstract_params(bad, "float32", plan))

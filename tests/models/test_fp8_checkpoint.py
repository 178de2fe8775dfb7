"""FP8 checkpoints (`quant_method: "fp8"`, `models.loaders.quant_formats.fp8`) served as
stored: block-wise (with edge blocks), per tensor, per channel (compressed-tensors), dense
layers, routed experts and DeepSeek-V3's latent attention, against transformers on the
dequantized weights."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from models.linear import serving_form
from models.linear.fp8 import Fp8Linear
from models.loaders import load_model
from models.loaders.quant_formats.fp8 import compressed_tensors_fp8, fp8_format
from models.loaders.safetensors_dir import SafetensorsDir, read_safetensors_header
from models.quant import QuantFormat, QuantPlan
from models.registry import arch_config_from_hf
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

    from jaxserve.parallel.layouts import make_tensor_parallel
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


# DeepSeek-V3 as its FP8 checkpoints ship (`models.mla`): q_a_proj, q_b_proj,
# kv_a_proj_with_mqa, kv_b_proj, o_proj, the dense MLP, the routed and shared experts in FP8
# blocks. Blocks of 16 cut q_a's and kv_a's 24 outputs, q_b's 24 inputs and the experts' 24
# (edge blocks of 8), as DeepSeek-V3's 128 cut kv_a's 576 outputs.
# NOTE: a vocabulary of 10240 (IDS and their continuations fit) halves the model's writing
# and loading; the engine test (tests/e2e/test_deepseek_fp8_engine.py) takes SmolLM2's.
DEEPSEEK_V3 = dict(vocab_size=10240, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                   q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                   n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                   moe_intermediate_size=24, first_k_dense_replace=1, n_shared_experts=1,
                   max_position_embeddings=128, initializer_range=0.1,
                   tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
DS_BLOCK = [16, 16]


def write_deepseek_fp8(directory: str, block=DS_BLOCK, seed: int = 0, **config):
    """A tiny random DeepSeek-V3 (`DEEPSEEK_V3` with `config` over it) saved in FP8 blocks
    `block` (its norms drawn around 1 so they matter) into `directory`; returns
    (transformers' model of the dequantized weights: the oracle, the dequantized tensors)."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**{**DEEPSEEK_V3, **config},
                                        attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    qc = {**FP8, "weight_block_size": list(block)}
    dense = write_fp8_dir(directory, hf, tuple(block), qc)
    return _dense_hf(directory + "-dense", directory, dense), dense


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fp8_deepseek") / "model")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf, dense = write_deepseek_fp8(directory)
    finally:
        torch.set_num_threads(threads)
    return directory, hf, dense


def test_deepseek_v3_fp8_loads_as_stored(deepseek_dir):
    """MLA's projections kept in their FP8 blocks (edge blocks included), kv_b_proj
    dequantized at load to the packer's inverse, the experts, shared experts and dense MLP
    in FP8, the router float."""
    directory, _, dense = deepseek_dir
    model = load_model(directory, quantization="auto")
    fmt = QuantFormat("fp8", 16, block_n=16)
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "experts.down_proj"):
        assert model.quant.get(name) == fmt, name
    assert model.quant.get("kv_b_proj") is None
    attn = model.params["layers"]["self_attn"]
    kv_a = attn["kv_a_proj_with_mqa"]
    assert kv_a["qweight"].dtype == np.dtype("float8_e4m3fn")
    assert kv_a["block_scales"].shape == (2, 4, 2)  # [L, 64 / 16, ceil(24 / 16)]
    assert attn["q_a_proj"]["block_scales"].shape == (2, 4, 2)
    assert attn["q_b_proj"]["block_scales"].shape == (2, 2, 4)  # ceil(24 / 16) input blocks
    for layer in range(2):  # kv_b_proj: the dequantized float kernel [R, H * (Dn + Dv)]
        np.testing.assert_array_equal(
            np.asarray(attn["kv_b_proj"]["kernel"][layer]),
            dense[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].T)
    mlp = model.params["layers"]["mlp"]
    assert mlp["shared_expert"]["gate_proj"]["qweight"].dtype == np.dtype("float8_e4m3fn")
    assert mlp["experts"]["down_proj"]["block_scales"].shape == (1, 4, 2, 4)  # 24 = 16 + 8
    assert "qweight" in model.params["layers"]["dense_mlp"]["down_proj"]
    assert "qweight" not in mlp["gate"]  # the router stays float


@pytest.mark.slow(reason="a DeepSeek step's compile (~4 s); the default tier loads the same "
                         "checkpoint (test_deepseek_v3_fp8_loads_as_stored) and the FP8 "
                         "method's numerics are the other models' here")
def test_deepseek_v3_fp8_equals_the_dequantized_model(deepseek_dir):
    """Served from those leaves: transformers' teacher-forced logits of the dequantized
    model (to float32 tolerance) and its greedy tokens."""
    directory, hf, _ = deepseek_dir
    _check_against(load_model(directory, quantization="auto"), hf, directory)


def test_deepseek_kv_a_in_128_blocks_reads_its_edge_block(tmp_path):
    """DeepSeek-V3's kv_a_proj_with_mqa [576, K] in 128x128 blocks: scales [5, K / 128], the
    last row block 64 rows; read as stored (the method's dense weight) and, as kv_b_proj,
    dequantized at load, both the packer's inverse."""
    from safetensors.numpy import save_file

    w = np.random.default_rng(4).normal(size=(576, 256)).astype(np.float32)
    q, s = pack_fp8(w, (128, 128))
    assert s.shape == (5, 2)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    save_file({name: q, name + "_scale_inv": s}, str(tmp_path / "model.safetensors"))
    cfg = arch_config_from_hf(dict(DEEPSEEK_V3, architectures=["DeepseekV3ForCausalLM"]))
    fmt = fp8_format({**FP8, "weight_block_size": [128, 128]}, str(tmp_path), cfg)
    assert fmt.plan.get("kv_a_proj_with_mqa") == QuantFormat("fp8", 128, block_n=128)
    source = SafetensorsDir(str(tmp_path))
    leaves = {k: v.T for k, v in fmt.reader(source, name).items()}
    want = unpack_fp8(q, s, (128, 128))
    got = Fp8Linear(QuantFormat("fp8", 128, block_n=128)).dense(leaves, np.float32)
    np.testing.assert_array_equal(np.asarray(got).T, want)
    np.testing.assert_array_equal(fmt.dense_reader(source, name), want)


KV_B = "model.layers.1.self_attn.kv_b_proj.weight"
KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


@pytest.mark.parametrize("tensors,match", [
    ({KV_B + "_scale_inv": None}, rf"{KV_B}_scale_inv' is missing .*needs its 'scale_inv'"),
    # floor(24 / 16) row blocks: the edge block's scale is missing.
    ({KV_A + "_scale_inv": np.ones((1, 4), np.float32)},
     rf"{KV_A}_scale_inv'.*float32\[1, 4\], expected float scales \[2, 4\]"),
    ({KV_A: np.zeros((24, 64), np.float32)}, rf"{KV_A}'.*float32\[24, 64\].*float8_e4m3fn"),
])
def test_bad_deepseek_fp8_files_name_the_tensor(deepseek_dir, tmp_path, tensors, match):
    directory = _broken(deepseek_dir[0], str(tmp_path / "bad"), tensors)
    with pytest.raises(ValueError, match=match):
        load_model(directory)

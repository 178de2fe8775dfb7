"""Mixture-of-experts GGUF files (Mixtral as arch `llama`, `qwen2moe` with its shared expert,
`qwen3moe`): tiny random transformers models written as llama.cpp's converter writes them
(`tests/models/moe_gguf.py`), in F32 and in Q8_0, loaded by jaxserve and compared with the
same weights from safetensors, with transformers' GGUF loader where it reads the
architecture (qwen2moe, qwen3moe: it reads no experts from a `llama` file) and with the
file's blocks dequantized by gguf-py; and the metadata errors on header-only files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from models.loaders import load_model, read_arch_config
from models.loaders.gguf_file import GGUFFile
from models.registry import arch_config_from_hf
from tests.models.helpers import forward_logits, hf_logits, write_gguf_header
from tests.models.moe_gguf import write_moe_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.test_numerics import CASES, PAGE_SIZE, build_hf, prompt  # noqa: E402

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
FAMILIES = ("mixtral_moe", "qwen2_moe_shared", "qwen3_moe_norm_topk")
SLOW = pytest.mark.slow  # a compile each: the default tier keeps one F32 and one Q8_0 case


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (name, transformers model, HF directory, F32 GGUF path, Q8_0 GGUF path),
    each family built once per module."""
    cache = {}

    def build(name: str):
        if name not in cache:
            case = next(c for c in CASES if c.name == name)
            directory = tmp_path_factory.mktemp(name)
            hf = build_hf(case, str(directory), seed=5)
            paths = []
            for qtype in (F32, Q8_0):
                paths.append(str(directory / f"{name}-{qtype.name}.gguf"))
                write_moe_gguf(str(directory), paths[-1], qtype)
            cache[name] = (name, hf, str(directory), *paths)
        return cache[name]

    return build


def _families(default: str) -> list:
    """Every family, `default`'s case in the default tier and the others slow."""
    return [pytest.param(n, marks=[] if n == default else [SLOW]) for n in FAMILIES]


def _transformers_gguf(hf, path: str):
    """transformers' GGUF loader on `path`, given the widths it does not read from MoE
    files (its qwen2_moe/qwen3_moe mappings have no `expert_feed_forward_length`)."""
    import os

    c = hf.config
    extra = {"moe_intermediate_size": c.moe_intermediate_size}
    if getattr(c, "shared_expert_intermediate_size", None):
        extra["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        attn_implementation="eager", **extra)
    assert type(model).__name__ == type(hf).__name__
    return model.eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_gguf_config_equals_hf_config(built, name):
    """The GGUF's architecture config is the original checkpoint's (experts, widths, the
    router's order and normalization, Mixtral read from a `llama` file)."""
    _, _, directory, f32, q8 = built(name)
    assert read_arch_config(f32) == read_arch_config(q8) == read_arch_config(directory)
    assert read_arch_config(f32).is_moe


@pytest.mark.parametrize("name", _families("qwen2_moe_shared"))
def test_moe_gguf_f32_logits(built, name):
    """F32 file: the same logits as the safetensors directory (the same weights, Mixtral's
    q/k permutation undone), and as transformers (its GGUF loader for the Qwen files, the
    original model for Mixtral)."""
    _, hf, directory, f32, _ = built(name)
    ids = prompt(160, seed=5)
    ours = forward_logits(load_model(f32, "float32"), ids, page_size=PAGE_SIZE)
    same = forward_logits(load_model(directory, "float32"), ids, page_size=PAGE_SIZE)
    np.testing.assert_array_equal(ours, same)
    oracle = hf if name == "mixtral_moe" else _transformers_gguf(hf, f32)
    ref = hf_logits(oracle, ids)
    assert ref.std() > 0.5
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", _families("mixtral_moe"))
def test_moe_gguf_q8_0_experts_stay_quantized(built, name):
    """Q8_0 file kept quantized (`quantization="gguf"`): the routed experts are q8 leaves
    with their [L, E] axes, and the logits are those of the file's blocks dequantized by
    gguf-py (the loader's "none"; transformers' GGUF loader for the Qwen files), close to
    the float checkpoint's."""
    _, hf, directory, _, q8 = built(name)
    kept = load_model(q8, "float32", quantization="gguf")
    formats = dict(kept.quant.formats)
    assert {formats[f"experts.{p}"].kind for p in ("gate_proj", "up_proj", "down_proj")} \
        == {"q8"}
    cfg = kept.cfg
    qweight = kept.params["layers"]["mlp"]["experts"]["down_proj"]["qweight"]
    assert qweight.shape == (cfg.num_layers, cfg.num_experts, cfg.moe_intermediate_size,
                             cfg.hidden_size) and qweight.dtype == np.int8
    ids = prompt(160, seed=5)
    ours = forward_logits(kept, ids, page_size=PAGE_SIZE)
    dequantized = forward_logits(load_model(q8, "float32", quantization="none"), ids,
                                 page_size=PAGE_SIZE)
    scale = np.abs(dequantized).max()
    np.testing.assert_allclose(ours, dequantized, rtol=0, atol=1e-5 * scale)
    if name != "mixtral_moe":
        np.testing.assert_allclose(ours, hf_logits(_transformers_gguf(hf, q8), ids), rtol=0,
                                   atol=1e-4)
    # Q8_0's error moves the logits a little (a flipped top-k choice moves a row more).
    floats = hf_logits(hf, ids)
    assert np.median(np.abs(ours - floats)) < 0.01 * np.abs(floats).max()
    assert (ours.argmax(-1) == floats.argmax(-1)).mean() >= 0.75


@pytest.mark.slow  # a compile more; Q8_0 is the default tier's block case
def test_moe_gguf_q4_0_experts_stay_quantized(built, tmp_path):
    """Q4_0 (two codes a byte, a zero per block) kept quantized: q4 expert leaves, the
    logits of gguf-py's dequantization and of transformers' GGUF loader."""
    _, hf, directory, _, _ = built("qwen3_moe_norm_topk")
    path = str(tmp_path / "q4_0.gguf")
    write_moe_gguf(directory, path, gguf.GGMLQuantizationType.Q4_0)
    kept = load_model(path, "float32", quantization="gguf")
    experts = kept.params["layers"]["mlp"]["experts"]["gate_proj"]
    assert dict(kept.quant.formats)["experts.gate_proj"].kind == "q4"
    assert experts["qweight"].dtype == np.uint8 and "zeros" in experts
    ids = prompt(160, seed=5)
    ours = forward_logits(kept, ids, page_size=PAGE_SIZE)
    dequantized = forward_logits(load_model(path, "float32", quantization="none"), ids,
                                 page_size=PAGE_SIZE)
    np.testing.assert_allclose(ours, dequantized, rtol=0,
                               atol=1e-5 * np.abs(dequantized).max())
    np.testing.assert_allclose(ours, hf_logits(_transformers_gguf(hf, path), ids), rtol=0,
                               atol=1e-4)


def test_moe_gguf_missing_expert_stack_is_named(built, tmp_path):
    directory = built("qwen3_moe_norm_topk")[2]
    path = str(tmp_path / "broken.gguf")
    write_moe_gguf(directory, path, drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight"):
        load_model(path, "float32")


BASE = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96,
        "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 160,
        "context_length": 64, "expert_count": 4, "expert_used_count": 2,
        "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 48}


def _header(tmp_path, arch: str, skip=(), tensors=None, **extra) -> str:
    """A GGUF file of `arch` with metadata only (plus `tensors`: {name: f32 array})."""
    fields = {k: v for k, v in ({**BASE, **extra}).items() if k not in skip}
    return write_gguf_header(str(tmp_path / f"{arch}.gguf"), arch, fields, tensors)


def _cfg(path: str):
    return arch_config_from_hf(GGUFFile(path).hf_config())


def test_moe_header_fields_and_defaults(tmp_path):
    """llama.cpp's router rules: Qwen3-MoE renormalizes its top-k weights, Qwen2-MoE does
    not, `expert_weights_norm` wins; Mixtral from a `llama` file; a width the metadata
    leaves out (older files) comes from the stacked tensor."""
    qwen3 = _cfg(_header(tmp_path, "qwen3moe"))
    assert (qwen3.architecture, qwen3.num_experts, qwen3.num_experts_per_tok,
            qwen3.moe_intermediate_size, qwen3.norm_topk_prob) == \
        ("Qwen3MoeForCausalLM", 4, 2, 32, True)
    qwen2 = _cfg(_header(tmp_path, "qwen2moe"))
    assert not qwen2.norm_topk_prob and qwen2.shared_expert_intermediate_size == 48
    assert _cfg(_header(tmp_path, "qwen2moe", expert_weights_norm=1)).norm_topk_prob
    mixtral = _cfg(_header(tmp_path, "llama", skip=("expert_feed_forward_length",)))
    assert (mixtral.architecture, mixtral.router_order, mixtral.moe_intermediate_size) == \
        ("MixtralForCausalLM", "topk_softmax", 96)
    assert not _cfg(_header(tmp_path, "llama", skip=("expert_count",))).is_moe
    stacked = np.zeros((4, 24, 64), np.float32)  # [E, out, in]: experts 24 wide
    old = _cfg(_header(tmp_path, "qwen3moe", skip=("expert_feed_forward_length",),
                       tensors={"blk.0.ffn_gate_exps.weight": stacked}))
    assert old.moe_intermediate_size == 24


@pytest.mark.parametrize("arch,kw,match", [
    ("qwen3moe", dict(skip=("expert_count",)), "qwen3moe.expert_count is missing"),
    ("qwen2moe", dict(skip=("expert_used_count",)), "qwen2moe.expert_used_count is missing"),
    ("qwen3moe", dict(expert_gating_func=2), r"expert_gating_func \(2\) is not supported"),
    ("llama", dict(expert_weights_scale=2.5), r"expert_weights_scale \(2.5\) is not"),
    ("qwen3moe", dict(skip=("expert_feed_forward_length",)),
     "expert_feed_forward_length is missing"),
    ("qwen2moe", dict(skip=("expert_shared_feed_forward_length",)),
     "expert_shared_feed_forward_length is missing"),
])
def test_moe_header_errors(tmp_path, arch, kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(_header(tmp_path, arch, **kw))


def test_per_expert_tensors_are_refused(tmp_path):
    path = _header(tmp_path, "llama", tensors={"blk.0.ffn_gate.0.weight":
                                               np.zeros((96, 64), np.float32)})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate\.0\.weight' holds one expert"):
        GGUFFile(path)

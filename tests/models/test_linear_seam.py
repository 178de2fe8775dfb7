"""The linear-method seam: models hold no backend code, and the registry's choices.

`models/` outside `models/linear/` (the method registry) names no backend, imports nothing
from the CPU kernels and never asks JAX for its platform: a weight format or a kernel
choice is a linear method, chosen once when the model is loaded (`choose_methods`).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ArchConfig
from models.linear import (
    ServingChoice,
    choose_methods,
    forward_context,
    serving_params,
    standard_params,
)
from models.linear.context import current
from models.linear.dense import FloatEmbed, FloatLinear, QuantEmbed, QuantLinear
from models.linear.lora import LoRALinear
from models.linear.panels import PanelEmbed, PanelLinear, kernels_available
from models.model import abstract_params
from models.quant import QuantFormat, quantize_params, uniform_plan

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"
REGISTRY = MODELS / "linear"
TINY = ArchConfig("LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  layer_windows=(0, 0), max_position_embeddings=64)
MOE = ArchConfig("Qwen3MoeForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=48,
                 num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, layer_windows=(0, 0),
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
Q8 = uniform_plan("int8", QuantFormat("q8", 0))


def _filled(cfg: ArchConfig, seed: int) -> dict:
    """A params tree of `cfg` (float32) filled with NumPy normals: the standard layout
    without compiling `init`."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda leaf: rng.standard_normal(leaf.shape).astype(np.float32),
        abstract_params(cfg, "float32"))


def _outside_registry() -> list[pathlib.Path]:
    files = [p for p in MODELS.rglob("*.py") if REGISTRY not in p.parents]
    assert len(files) > 20  # the walk found the package
    return files


def test_models_name_no_backend_outside_the_registry():
    """The acceptance grep: `backend`, `cpu_ffi`, `packed`, `default_backend` appear in
    `models/` only in the method registry (compressed-tensors' checkpoint tensor
    `weight_packed` is a file's field name, not a packing of ours)."""
    hits = [f"{p.relative_to(MODELS)}:{i}: {line.strip()}"
            for p in _outside_registry()
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"backend|cpu_ffi|(?<!weight_)packed|default_backend", line)]
    assert not hits, "\n".join(hits)


def test_models_import_nothing_cpu_specific_outside_the_registry():
    for path in _outside_registry():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad = [n for n in names if n.startswith("pallas_kernels.cpu_ffi")]
            assert not bad, f"{path.relative_to(MODELS)} imports {bad}"


def _methods(cfg=TINY, plan=Q8, **choice):
    return choose_methods(cfg, plan, jnp.float32, ServingChoice(**choice))


def test_the_registry_picks_each_modules_method():
    xla = _methods(backend="xla")
    assert xla.linear("q_proj") == QuantLinear(Q8.get("q_proj"), jnp.float32, "xla")
    assert xla.linear("gate") == FloatLinear(jnp.float32)  # routers are never quantized
    assert xla.embedding == QuantEmbed(Q8.get("embed_tokens"), jnp.float32, "xla")
    assert xla.backend == "xla" and xla.kv_dtype == jnp.float32
    pallas = _methods(backend="pallas")
    assert pallas.linear("down_proj").kernel == "pallas"
    assert pallas.linear("lm_head").kernel == "pallas"
    invariant = _methods(backend="xla", batch_invariant=True)
    assert invariant.linear("o_proj").row_tile > 0 and invariant.attention.batch_invariant
    gguf = choose_methods(TINY, uniform_plan("gguf", QuantFormat("q4", 32)), jnp.float32,
                          ServingChoice("cpu"))
    assert gguf.kv_dtype == jnp.float16  # llama.cpp's cache type under a GGUF's blocks
    assert choose_methods(TINY, uniform_plan("gguf", QuantFormat("q4", 32)), jnp.float32,
                          ServingChoice("xla")).kv_dtype == jnp.float32


def test_lora_wraps_the_targets_only():
    dense = _methods(backend="xla", lora_impl="masked")
    assert isinstance(dense.linear("gate_proj"), LoRALinear)
    assert isinstance(dense.linear("q_proj").base, QuantLinear)
    assert not isinstance(dense.linear("lm_head"), LoRALinear)
    moe = choose_methods(MOE, choice=ServingChoice("xla", lora_impl="gathered"))
    assert isinstance(moe.linear("v_proj"), LoRALinear)
    assert not isinstance(moe.linear("gate_proj"), LoRALinear)  # the shared expert's
    assert not moe.lora_whole and _methods(backend="xla", lora_impl="grouped").lora_whole


@pytest.mark.skipif(not kernels_available(True), reason="the CPU kernels do not build here")
@pytest.mark.parametrize("tied", [True, False])
def test_panels_round_trip_the_standard_tree(tied):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied, qkv_bias=True)
    params = quantize_params(_filled(cfg, seed=1), Q8)
    methods = choose_methods(cfg, Q8, jnp.float32, ServingChoice("cpu", panels=True))
    assert methods.linear("v_proj") == PanelLinear(Q8.get("v_proj"))
    assert methods.embedding == (PanelEmbed(Q8.get("embed_tokens")) if tied
                                 else QuantEmbed(Q8.get("embed_tokens"), jnp.float32, "xla"))
    served = serving_params(params, methods)
    assert "q_proj" in served["params"]["layers"]["self_attn"]  # its bias stays a param
    back = standard_params(served, cfg)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)


def test_whole_experts_move_to_the_stacks_and_back():
    params = _filled(MOE, seed=2)
    methods = choose_methods(MOE, choice=ServingChoice("xla", whole_experts=True))
    served = serving_params(params, methods)
    assert "experts" not in served["params"]["layers"]["mlp"]
    assert served["stacks"]["layers"]["mlp"]["experts"]["up_proj"].shape == (2, 4, 32, 16)
    jax.tree_util.tree_map(np.testing.assert_array_equal, standard_params(served, MOE), params)
    same = serving_params(params, choose_methods(MOE))  # nothing to move
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: a is b, same, params))


def test_panels_refused_where_they_cannot_serve():
    with pytest.raises(ValueError, match="packing the weights into panels needs the 'cpu'"):
        _methods(backend="xla", panels=True)
    with pytest.raises(ValueError, match="unknown attention backend 'tpu-v9'"):
        ServingChoice("tpu-v9")


def test_forward_context_nests_and_resets():
    assert current().real_rows is None and current().lora_slots is None
    with forward_context(real_rows=3):
        with forward_context(lora_slots="slots"):
            assert (current().real_rows, current().lora_slots) == (3, "slots")
        assert (current().real_rows, current().lora_slots) == (3, None)
    assert current().real_rows is None
    with pytest.raises(TypeError), forward_context(rows=1):
        pass


def test_float_methods_declare_flax_dense_leaves():
    """`FloatLinear`/`FloatEmbed` hold what `nn.Dense`/`nn.Embed` hold (checkpoints and
    loaders see the same tree whatever serves it)."""
    params = abstract_params(TINY, "float32")
    assert set(params["layers"]["self_attn"]["q_proj"]) == {"kernel"}
    assert params["layers"]["self_attn"]["q_proj"]["kernel"].shape == (2, 64, 64)
    assert set(params["embed_tokens"]) == {"embedding"}
    assert FloatEmbed(jnp.float32).attend(jnp.eye(3, 4), jnp.ones((2, 4))).shape == (2, 3)


def test_lora_stacks_on_a_model_served_without_adapters_are_an_error():
    from models.model import Model
    from pallas_kernels import AttentionMetadata

    model = Model(TINY, _filled(TINY, seed=0), serving=ServingChoice("xla"))
    md = AttentionMetadata(jnp.zeros(2, jnp.int32), jnp.zeros((1, 1), jnp.int32),
                           jnp.full(1, 2, jnp.int32), jnp.asarray([0, 2], jnp.int32))
    kv = jnp.zeros(model.kv_pages_shape(2, 4))
    ids = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="not served with adapters: set "
                                         "ServingChoice.lora_impl"):
        model.forward(model.params, ids, ids, kv, md, lora={}, lora_slots=ids)


@pytest.mark.parametrize("method", [FloatLinear(jnp.float32), FloatLinear(jnp.bfloat16),
                                    QuantLinear(QuantFormat("q8", 0)),
                                    QuantLinear(QuantFormat("q8", 32)),
                                    QuantLinear(QuantFormat("q4", 32))])
def test_a_methods_bytes_are_its_leaves(method):
    """`nbytes` (memory accounting before anything loads) counts what `weights` declares."""
    import flax.linen as nn

    class One(nn.Module):
        @nn.compact
        def __call__(self):
            return method.weights(self, 64, 96)

    leaves = jax.eval_shape(lambda: One().init(jax.random.key(0)))["params"]
    got = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(leaves))
    assert method.nbytes(64, 96) == got
    assert got < 64 * 96 * 4 or isinstance(method, FloatLinear)

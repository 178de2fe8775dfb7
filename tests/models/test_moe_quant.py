"""Quantized routed experts (`models/moe.py` over `models.quant` leaves): the grouped matmul
on quantized stacks against the dense reference on the weights dequantized by the NumPy
oracle (`models.quant.dequantize_rows`), both implementations, the layer-stack (serving)
form, pairs dropped past E, and the model's parameter tree under an int8 plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ArchConfig
from models.linear import STACKS, ServingChoice, choose_methods, serving_form
from models.model import Model, abstract_params, random_params
from models.moe import GROUPED_IMPLS, MoEMLP, dense_experts, grouped_experts, route
from models.quant import QuantFormat, dequantize_rows, quantize_stack, uniform_plan

E, H, FF = 8, 32, 64  # experts, hidden, one expert's width (multiples of the q4 block)
FORMATS = {"int8": QuantFormat("q8", 0), "q8_0": QuantFormat("q8", 32),
           "q4": QuantFormat("q4", 32)}


def _float_experts(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {"gate_proj": np.asarray(jax.random.normal(k[0], (E, H, FF))),
            "up_proj": np.asarray(jax.random.normal(k[1], (E, H, FF))),
            "down_proj": np.asarray(jax.random.normal(k[2], (E, FF, H)))}


def _oracle_dequantize(fmt: QuantFormat, leaves: dict) -> np.ndarray:
    """f32[..., K, N] from on-device leaves [..., K', N], one kernel at a time through the
    row-form NumPy oracle (the device layout is the row form transposed)."""
    lead = leaves["qweight"].shape[:-2]
    flat = {k: np.asarray(v).reshape(-1, *v.shape[-2:]) for k, v in leaves.items()}
    kernels = [dequantize_rows(fmt, {k: v[i].T for k, v in flat.items()}).T
               for i in range(flat["qweight"].shape[0])]
    return np.stack(kernels).reshape(*lead, *kernels[0].shape)


def _quantized(fmt: QuantFormat, experts: dict) -> tuple[dict, dict]:
    """(quantized stacks as device leaves, their dequantization by the NumPy oracle)."""
    q = {n: quantize_stack(fmt, w) for n, w in experts.items()}
    deq = {n: _oracle_dequantize(fmt, leaves) for n, leaves in q.items()}
    return jax.tree_util.tree_map(jnp.asarray, q), deq


def _routing(num_tokens: int, seed: int = 1):
    """Softmax-top-2 routing where most tokens pick expert 0 and experts 5-7 get none."""
    logits = jax.random.normal(jax.random.key(seed), (num_tokens, E))
    logits = logits.at[:, 0].add(3.0).at[:, 5:].add(-50.0)
    return route(logits, 2, "softmax_topk", True)


@pytest.mark.parametrize("impl", GROUPED_IMPLS)
@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
def test_quantized_grouped_equals_dense_on_dequantized(impl, fmt):
    fmt = FORMATS[fmt]
    floats = _float_experts()
    q, deq = _quantized(fmt, floats)
    for name in floats:  # the codes are real: a visible quantization error, but small
        err = np.abs(deq[name] - floats[name]).max()
        assert 0 < err < (0.05 if fmt.kind == "q8" else 0.5), (name, err)
    x = jax.random.normal(jax.random.key(2), (12, H))
    weights, ids = _routing(12)
    ours = grouped_experts(x, weights, ids, q, impl=impl)
    ref = dense_experts(x, weights, ids, deq)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())
    # The oracle tells the dequantized weights from the float ones.
    assert np.abs(np.asarray(dense_experts(x, weights, ids, floats)) - ref).max() > 1e-3


@pytest.mark.parametrize("impl", GROUPED_IMPLS)
def test_quantized_layer_stack_and_dropped_pairs(impl):
    """The serving form's [L, E, ...] leaves read at a traced layer, and pairs mapped past E
    (as expert parallelism drops another device's pairs) skipped."""
    fmt = FORMATS["q4"]
    q0, _ = _quantized(fmt, _float_experts(seed=3))
    q1, deq1 = _quantized(fmt, _float_experts(seed=4))
    stacked = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), q0, q1)
    x = jax.random.normal(jax.random.key(5), (9, H))
    weights, ids = _routing(9, seed=6)
    dropped = np.zeros(ids.shape, bool)
    dropped[::2, 1] = True  # every other token's second pair goes to "another device"
    ids_out = jnp.where(dropped, E + 1, ids)
    fn = jax.jit(lambda x, w, i, layer: grouped_experts(x, w, i, stacked, impl=impl,
                                                          layer=layer))
    ours = fn(x, weights, ids_out, jnp.int32(1))
    ref = dense_experts(x, jnp.where(dropped, 0.0, weights), ids, deq1)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-4 * np.abs(ref).max())


def _cfg(**kw) -> ArchConfig:
    base = dict(architecture="Qwen2MoeForCausalLM", vocab_size=64, hidden_size=H,
                intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                num_experts=E, num_experts_per_tok=2, moe_intermediate_size=FF,
                shared_expert_intermediate_size=32)
    return ArchConfig(**{**base, **kw})


def test_int8_plan_quantizes_the_expert_stacks():
    """Under int8 the expert stacks become q8 leaves with the [L, E] axes; the plan-built
    tree (loaders) and the quantized random tree agree; the layer grouped equals its
    dense reference on the same leaves, in the params and in the serving form."""
    cfg = _cfg()
    plan = uniform_plan("int8", FORMATS["int8"])
    tree = abstract_params(cfg, "float32", plan)
    experts = tree["layers"]["mlp"]["experts"]
    assert experts["gate_proj"]["qweight"].shape == (2, E, H, FF)
    assert experts["gate_proj"]["qweight"].dtype == jnp.int8
    assert experts["down_proj"]["scales"].shape == (2, E, 1, H)
    params = random_params(cfg, quant=plan)
    assert (jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(tree))
    model = Model(cfg, params, quant=plan, serving=ServingChoice("xla"))
    served = serving_form(model, whole_experts=True)
    assert "qweight" in served.params[STACKS]["layers"]["mlp"]["experts"]["up_proj"]

    x = jax.random.normal(jax.random.key(7), (6, H))
    layer_params = jax.tree_util.tree_map(lambda v: v[1], params["layers"]["mlp"])
    methods = choose_methods(cfg, plan)
    mlp = MoEMLP(cfg, jnp.float32, methods)
    ours = mlp.apply({"params": layer_params}, x)
    ref = MoEMLP(cfg, jnp.float32, methods, reference=True).apply({"params": layer_params}, x)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    # The serving form: the whole [L, E] stacks in the broadcast collection, layer 1 read.
    rest = {k: v for k, v in layer_params.items() if k != "experts"}
    stacks = {"experts": served.params[STACKS]["layers"]["mlp"]["experts"]}
    form = mlp.apply({"params": rest, STACKS: stacks}, x, jnp.int32(1))
    np.testing.assert_allclose(form, ours, rtol=1e-5, atol=1e-5)


def test_quantized_experts_that_do_not_fit_are_named():
    q, _ = _quantized(FORMATS["q8_0"], _float_experts())
    weights, ids = _routing(2)
    bad = dict(q, down_proj=jax.tree_util.tree_map(lambda v: v[:, :, :-1], q["down_proj"]))
    with pytest.raises(ValueError, match="do not fit tokens"):
        grouped_experts(jnp.zeros((2, H)), weights, ids, bad)
    with pytest.raises(ValueError, match="block 32 does not divide"):
        quantize_stack(FORMATS["q8_0"], np.zeros((E, 48, FF), np.float32))

"""The MoE layer (`models/moe.py`): routers against transformers' own, the grouped experts
against the dense reference, and the MoE config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ArchConfig
from models.linear import STACKS, ServingChoice, choose_methods, serving_form
from models.moe import GROUPED_IMPLS, MoEMLP, dense_experts, grouped_experts, route
from models.registry import arch_config_from_hf

E, H, FF = 8, 16, 12  # experts, hidden, one expert's width


def _experts(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {"gate_proj": jax.random.normal(k[0], (E, H, FF)),
            "up_proj": jax.random.normal(k[1], (E, H, FF)),
            "down_proj": jax.random.normal(k[2], (E, FF, H))}


def _logits(num_tokens: int, skew: bool, seed: int = 1) -> jax.Array:
    logits = jax.random.normal(jax.random.key(seed), (num_tokens, E))
    if skew:  # most tokens' first choice is expert 0; experts 5-7 get no token
        logits = logits.at[:, 0].add(3.0).at[:, 5:].add(-50.0)
    return logits


# NOTE: 3 tokens (6 assignments to 8 experts) in the slow tier: each token count compiles
# its own grouped matmul (~3 s); 1 token (a decode row) and 40 stay, each spread and with
# empty experts (skewed).
@pytest.mark.parametrize("impl", GROUPED_IMPLS)
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
@pytest.mark.parametrize("num_tokens", [1, pytest.param(3, marks=pytest.mark.slow(
    reason="a third token count; 1 and 40 run the same grouped paths")), 40])
def test_grouped_matches_dense_reference(impl, skew, num_tokens):
    experts = _experts()
    x = jax.random.normal(jax.random.key(2), (num_tokens, H))
    weights, ids = route(_logits(num_tokens, skew), 2, "softmax_topk", True)
    if skew:
        counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
        assert counts[5:].sum() == 0 and counts[0] >= (num_tokens + 1) // 2
    ours = grouped_experts(x, weights, ids, experts, impl=impl)
    ref = dense_experts(x, weights, ids, experts)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-4)
    # The reference is not trivially what the grouped path does: another routing differs.
    other = dense_experts(x, weights, (ids + 1) % E, experts)
    assert np.abs(np.asarray(other) - np.asarray(ref)).max() > 1e-2


def test_grouped_jit_one_program_any_routing():
    """The routing is traced: one compiled program serves every routing of a shape."""
    experts = _experts()
    x = jax.random.normal(jax.random.key(2), (6, H))
    fn = jax.jit(lambda x, w, i: grouped_experts(x, w, i, experts, impl="loop"))
    for skew in (False, True):
        w, ids = route(_logits(6, skew), 2, "topk_softmax", False)
        np.testing.assert_allclose(fn(x, w, ids), dense_experts(x, w, ids, experts),
                                   rtol=1e-5, atol=1e-4)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("order,norm,cls", [
    ("topk_softmax", False, "MixtralTopKRouter"),
    ("softmax_topk", False, "Qwen2MoeTopKRouter"),
    ("softmax_topk", True, "Qwen2MoeTopKRouter"),
])
def test_router_matches_transformers(order, norm, cls):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if cls == "MixtralTopKRouter":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router
        config = transformers.MixtralConfig(hidden_size=H, num_local_experts=E,
                                            num_experts_per_tok=3)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import (
            Qwen2MoeTopKRouter as Router,
        )
        config = transformers.Qwen2MoeConfig(hidden_size=H, num_experts=E,
                                             num_experts_per_tok=3, norm_topk_prob=norm)
    router = Router(config)
    w = np.random.default_rng(0).normal(size=(E, H)).astype(np.float32)
    x = np.random.default_rng(1).normal(size=(10, H)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        _, ref_w, ref_ids = router(torch.from_numpy(x))
    weights, ids = route(jnp.asarray(x @ w.T), 3, order, norm)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids.numpy())
    np.testing.assert_allclose(np.asarray(weights), ref_w.numpy(), rtol=1e-5, atol=1e-6)


def test_route_and_grouped_errors():
    logits = jnp.zeros((2, E))
    with pytest.raises(ValueError, match="router order 'sideways'"):
        route(logits, 2, "sideways", False)
    with pytest.raises(ValueError, match="top_k=9"):
        route(logits, 9, "softmax_topk", False)
    experts = _experts()
    w, ids = route(logits, 2, "softmax_topk", False)
    with pytest.raises(ValueError, match="do not fit tokens"):
        grouped_experts(jnp.zeros((2, H + 1)), w, ids, experts)
    with pytest.raises(ValueError, match="grouped matmul 'magic'"):
        grouped_experts(jnp.zeros((2, H)), w, ids, experts, impl="magic")


def _cfg(**kw) -> ArchConfig:
    base = dict(architecture="Qwen3MoeForCausalLM", vocab_size=32, hidden_size=H,
                intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                num_experts=E, num_experts_per_tok=2, moe_intermediate_size=FF)
    return ArchConfig(**{**base, **kw})


def _moe(cfg: ArchConfig, **kw) -> MoEMLP:
    """The layer with the platform's default methods (float weights)."""
    return MoEMLP(cfg, jnp.float32, choose_methods(cfg), **kw)


def test_moe_mlp_grouped_equals_its_reference():
    """The layer (router, experts, Qwen2-MoE's gated shared expert) grouped and dense."""
    cfg = _cfg(shared_expert_intermediate_size=20, norm_topk_prob=True)
    x = jax.random.normal(jax.random.key(3), (12, H))
    params = _moe(cfg).init(jax.random.key(4), x)
    assert params["params"]["experts"]["gate_proj"].shape == (E, H, FF)
    assert params["params"]["shared_expert"]["gate_proj"]["kernel"].shape == (H, 20)
    ours = _moe(cfg).apply(params, x)
    ref = _moe(cfg, reference=True).apply(params, x)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    no_shared = _moe(_cfg(norm_topk_prob=True)).apply(
        {"params": {k: v for k, v in params["params"].items()
                    if k not in ("shared_expert", "shared_expert_gate")}}, x)
    assert np.abs(np.asarray(no_shared) - np.asarray(ours)).max() > 1e-3


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(router_order="random"), "router_order 'random'"),
    (dict(num_experts=-1), "num_experts"),
])
def test_arch_config_moe_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


HF_MOE = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=12)


@pytest.mark.parametrize("arch,extra,match", [
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[1, 4]), r"mlp_only_layers=\[1, 4\].*0\.\.3"),
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[-1]), r"mlp_only_layers=\[-1\]"),
    ("Qwen2MoeForCausalLM", dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    ("Qwen2MoeForCausalLM", dict(decoder_sparse_step=5), "decoder_sparse_step=5 leave no sparse"),
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[2], decoder_sparse_step=3),
     "leave no sparse layer"),
    ("Qwen3MoeForCausalLM", dict(num_experts=0), "num_experts=0"),
    ("OlmoeForCausalLM", dict(clip_qkv=8.0), "clip_qkv=8.0"),
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=5),
     "num_experts_per_tok=5"),
])
def test_family_config_errors(arch, extra, match):
    with pytest.raises(ValueError, match=match):
        arch_config_from_hf({**HF_MOE, "architectures": [arch], **extra})


def test_family_configs_parse():
    mixtral = arch_config_from_hf({**HF_MOE, "architectures": ["MixtralForCausalLM"],
                                   "num_local_experts": 4, "sliding_window": 6})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.router_order,
            mixtral.layer_windows) == (4, 24, "topk_softmax", (6,) * 4)
    qwen3 = arch_config_from_hf({**HF_MOE, "architectures": ["Qwen3MoeForCausalLM"],
                                 "norm_topk_prob": True, "mlp_only_layers": [],
                                 "use_sliding_window": True, "sliding_window": 5})
    assert (qwen3.norm_topk_prob, qwen3.qk_norm, qwen3.layer_windows) == (True, True, (5,) * 4)
    olmoe = arch_config_from_hf({**HF_MOE, "architectures": ["OlmoeForCausalLM"]})
    assert (olmoe.qk_norm_full, olmoe.moe_intermediate_size) == (True, 24)


@pytest.mark.parametrize("arch,extra,dense", [
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[1]), (1,)),
    ("Qwen2MoeForCausalLM", dict(decoder_sparse_step=2), (0, 2)),  # layer i: (i + 1) % 2
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[3], decoder_sparse_step=2), (0, 2, 3)),
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=None, decoder_sparse_step=None), ()),
    # transformers' Mixtral and OLMoE read neither field: every layer stays sparse.
    ("MixtralForCausalLM", dict(num_local_experts=4, mlp_only_layers=[1]), ()),
    ("OlmoeForCausalLM", dict(decoder_sparse_step=2), ()),
])
def test_dense_layers_follow_transformers_rule(arch, extra, dense):
    cfg = arch_config_from_hf({**HF_MOE, "architectures": [arch], **extra})
    assert cfg.dense_layers == dense and cfg.is_mixed == bool(dense)
    assert cfg.sparse_layers == tuple(i for i in range(4) if i not in dense)


@pytest.mark.parametrize("kw,match", [
    (dict(dense_layers=(1,), num_experts=0), r"dense_layers=\[1\] needs a mixture"),
    (dict(dense_layers=(0, 0)), r"dense_layers=\[0, 0\] must be distinct"),
    (dict(dense_layers=(2,)), r"dense_layers=\[2\] must be distinct layers in 0\.\.1"),
    (dict(dense_layers=(0, 1)), "leaves no sparse layer"),
])
def test_arch_config_dense_layers_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(num_layers=2, **kw)


@pytest.mark.parametrize("impl", GROUPED_IMPLS)
def test_grouped_reads_its_layer_of_the_whole_stack(impl):
    """The serving form (`whole_experts`): the experts of every layer, indexed by the
    traced layer, give that layer's experts' result."""
    layers = [_experts(seed) for seed in (5, 6, 7)]
    stack = {k: jnp.stack([e[k] for e in layers]) for k in layers[0]}  # [L, E, ...]
    x = jax.random.normal(jax.random.key(2), (10, H))
    weights, ids = route(_logits(10, False), 2, "softmax_topk", False)
    fn = jax.jit(lambda layer: grouped_experts(x, weights, ids, stack, impl=impl, layer=layer))
    for layer, experts in enumerate(layers):
        np.testing.assert_allclose(fn(jnp.int32(layer)),
                                   dense_experts(x, weights, ids, experts),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # the engine serves this form in tests/e2e/test_moe_greedy.py
def test_broadcast_experts_serves_the_same_logits():
    """A model moved to the serving form gives the logits of the plain one."""
    from models.model import Model, random_params
    from tests.models.helpers import forward_logits

    cfg = _cfg(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
               shared_expert_intermediate_size=8)
    model = Model(cfg, random_params(cfg), serving=ServingChoice("xla"))
    served = serving_form(model, whole_experts=True)
    assert "experts" not in served.params["params"]["layers"]["mlp"]
    assert served.params[STACKS]["layers"]["mlp"]["experts"]["gate_proj"].shape == (
        2, E, H, FF)
    assert serving_form(served, whole_experts=True) is served
    ids = list(range(1, 20))
    np.testing.assert_allclose(forward_logits(served, ids, page_size=4),
                               forward_logits(model, ids, page_size=4), rtol=1e-5, atol=1e-5)


def test_mixed_mlp_runs_each_layers_own_mlp():
    """`MixedMLP` at a traced layer equals that layer's `MoEMLP` or `GatedMLP` on its
    slice of the stacks (one program for every layer); without the stacks in the broadcast
    collection it is a ValueError naming the fix."""
    from models.layers import GatedMLP
    from models.mixed import DENSE, MixedMLP, broadcast_mlp, mlp_index

    cfg = _cfg(num_layers=3, dense_layers=(1,), shared_expert_intermediate_size=8)
    x = jax.random.normal(jax.random.key(5), (7, H))
    stack = lambda trees: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)
    methods = choose_methods(cfg)
    dense_mlp = GatedMLP(cfg, jnp.float32, methods)
    layers = {"mlp": stack([_moe(cfg).init(jax.random.key(s), x)["params"] for s in (0, 2)]),
              DENSE: stack([dense_mlp.init(jax.random.key(1), x)["params"]])}
    collection = broadcast_mlp({"params": {"layers": layers}})[STACKS]["layers"]["mlp"]
    mixed = MixedMLP(cfg, jnp.float32, methods)
    fn = jax.jit(lambda layer: mixed.apply({STACKS: collection}, x, layer))
    at = lambda tree, i: jax.tree_util.tree_map(lambda a: a[i], tree)
    outs = []
    for layer, index in enumerate(mlp_index(cfg)):
        if layer in cfg.dense_layers:
            want = dense_mlp.apply({"params": at(layers[DENSE], index)}, x)
        else:
            want = _moe(cfg).apply({"params": at(layers["mlp"], index)}, x)
        outs.append(fn(jnp.int32(layer)))
        np.testing.assert_allclose(outs[-1], want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(outs[0]) - np.asarray(outs[2])).max() > 1e-3  # own weights
    assert fn._cache_size() == 1
    with pytest.raises(ValueError, match="apply it with models.model.variables"):
        mixed.apply({"params": {}}, x, jnp.int32(0))

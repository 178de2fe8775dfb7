"""Tensor parallelism over quantized weights and 8-bit KV pages: the one-device greedy tokens,
with codes, scales and zeros sharded like the float kernels they replace and the page pool
(codes and in-row scales) split on its KV-head axis."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.model import Model, random_params
from models.quant import EXPERT_MODULES, QuantFormat, QuantPlan, uniform_plan
from tests.parallel.test_parallel_engine import SMALL, TINY, _tiny_prompts, _tokens

GREEDY = SamplingParams(temperature=0, max_tokens=12, detokenize=False)
# 4-bit blocks of 32 and int8 per output channel: row-parallel o/down_proj split K, so at
# tp=4 a 64-wide K would hold half a 4-bit block per device (refused: a split cuts no group);
# int8's one scale per column stays whole beside its split codes.
PLANS = {"q4": uniform_plan("q4", QuantFormat("q4", 32)),
         "int8": uniform_plan("int8", QuantFormat("q8", 0))}

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")


@pytest.fixture(scope="module", params=[
    "q4", pytest.param("int8", marks=pytest.mark.slow)])
def quantized(request, smollm2_tokenizer):
    """(model, one-device greedy tokens over an int8 KV pool)."""
    plan = PLANS[request.param]
    params = jax.tree_util.tree_map(lambda x: x * 3.0, random_params(TINY, seed=3))
    from models.quant import quantize_params

    model = Model(TINY, jax.device_put(quantize_params(params, plan)), quant=plan)
    llm = LLM(model, tokenizer=smollm2_tokenizer, kv_cache_dtype="int8", num_kv_blocks=64,
              warmup=False, **SMALL)
    return model, _tokens(llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False))


# NOTE: slow tier (the default tier's 15 minutes, session 30): the float model's tensor
# parallelism stays in the default tier (tests/parallel/test_parallel_engine.py).
@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_quantized_tensor_parallel_matches_one_device(quantized, smollm2_tokenizer, size):
    model, want = quantized
    if size == 4 and model.quant.name == "q4":
        with pytest.raises(ValueError, match=r"layers/self_attn/o_proj: a q4 weight of 64 "
                                             r"inputs in groups of 32 cannot be split 4 ways"):
            LLM(model, tokenizer=smollm2_tokenizer, tensor_parallel_size=size, warmup=False,
                **SMALL)
        return
    llm = LLM(model, tokenizer=smollm2_tokenizer, tensor_parallel_size=size,
              kv_cache_dtype="int8", num_kv_blocks=64, warmup=False, **SMALL)
    assert _tokens(llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False)) == want
    params = llm.engine.runner.params
    qweight = params["layers"]["self_attn"]["q_proj"]["qweight"]
    assert qweight.dtype in (np.int8, np.uint8)  # still quantized on the mesh
    assert len(qweight.sharding.device_set) == size
    assert qweight.sharding.spec[-1] is not None  # column-parallel codes are split
    pool = llm.engine.runner.kv_pages
    assert pool.dtype == np.int8 and pool.sharding.spec[2] == "kv"


def test_quantized_expert_stacks_split_as_their_float_stacks():
    """A mixture of experts under int8 and tensor parallelism 2: the routed experts' codes
    and scales split on each expert's width as the float stacks do (gate/up's last axis,
    down's input axis; down's one row of per-column scales stays whole, it scales each
    partial sum), never on the layer or expert axes; the shared expert splits as the dense
    MLP does."""
    from jax.sharding import PartitionSpec as P

    from jaxserve.parallel.layouts import make_tensor_parallel
    from models.config import ArchConfig
    from models.model import abstract_params

    cfg = ArchConfig(architecture="Qwen2MoeForCausalLM", vocab_size=64, hidden_size=64,
                     intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=64)
    specs = make_tensor_parallel(cfg, 2).param_specs(
        abstract_params(cfg, "float32", PLANS["int8"]))
    mlp = specs["layers"]["mlp"]
    assert set(mlp["experts"]["gate_proj"]) == {"qweight", "scales"}
    width = ("kv", "rep")
    for name in ("gate_proj", "up_proj"):
        assert mlp["experts"][name]["qweight"] == P(None, None, None, width)
        assert mlp["experts"][name]["scales"] == P(None, None, None, width)
    assert mlp["experts"]["down_proj"]["qweight"] == P(None, None, width, None)
    assert mlp["experts"]["down_proj"]["scales"] == P(None, None, None, None)
    assert mlp["shared_expert"]["gate_proj"]["qweight"][-1] is not None


@pytest.mark.parametrize("group, size, layer", [
    (32, 2, None), (32, 4, "layers/mlp/down_proj"), (0, 4, None)])
def test_a_split_that_cuts_a_group_is_refused_naming_the_layer(group, size, layer):
    """A checkpoint's int4 groups (GPTQ/AWQ) under tensor parallelism: row-parallel
    o_proj/down_proj split K on group boundaries only; one group per output channel (0)
    stays whole beside the split codes. Here o_proj's K is 128, down_proj's 192."""
    from jaxserve.parallel.layouts import make_tensor_parallel
    from models.config import ArchConfig
    from models.model import abstract_params

    cfg = ArchConfig("LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=192,
                     num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16)
    plan = uniform_plan("gptq", QuantFormat("q4", group, "float32"), LINEARS)
    tp = make_tensor_parallel(cfg, size)
    params = abstract_params(cfg, "float32", plan)
    if layer is None:
        specs = tp.param_specs(params)
        assert specs["layers"]["self_attn"]["o_proj"]["qweight"][-2] is not None
        return
    with pytest.raises(ValueError, match=rf"^{layer}: a q4 weight of 192 inputs in groups of "
                                         rf"{group} cannot be split {size} ways"):
        tp.param_specs(params)


def test_a_split_that_cuts_a_group_of_an_expert_stack_is_refused():
    """The routed experts' down_proj splits its K (each expert's width) on group
    boundaries too: a width of 48 in groups of 32 over two devices is refused."""
    from jaxserve.parallel.layouts import make_tensor_parallel
    from models.config import ArchConfig
    from models.model import abstract_params

    cfg = ArchConfig(architecture="Qwen2MoeForCausalLM", vocab_size=64, hidden_size=64,
                     intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=96)
    plan = uniform_plan("awq", QuantFormat("q4", 32, "float32"), (*LINEARS, *EXPERT_MODULES))
    with pytest.raises(ValueError, match=r"experts/down_proj: a q4 weight of 96 inputs"):
        make_tensor_parallel(cfg, 2).param_specs(abstract_params(cfg, "float32", plan))


def _act_order_plan(permuted):
    """GPTQ-like int4 in groups of 32 whose `permuted` modules are act-order."""
    return QuantPlan(tuple((m, QuantFormat("q4", 32, act_order=m in permuted))
                           for m in (*LINEARS, *EXPERT_MODULES)), "gptq")


@pytest.mark.parametrize("permuted, layer", [
    (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), None),
    (("q_proj", "o_proj"), "layers/self_attn/o_proj"),
    (("down_proj",), "layers/mlp/shared_expert/down_proj"),
    (("experts.down_proj",), "layers/mlp/experts/down_proj")])
def test_an_act_order_row_parallel_split_is_refused_naming_the_layer(permuted, layer):
    """Act-order weights under tensor parallelism 2: a column-parallel layer splits its
    sorted codes on N and keeps its permutation whole on every device; a row-parallel one
    (o_proj, down_proj, the experts' down_proj: split along K) would hold inputs from
    anywhere in K on each device, and is refused naming the layer."""
    from jax.sharding import PartitionSpec as P

    from jaxserve.parallel.layouts import make_tensor_parallel
    from models.config import ArchConfig
    from models.model import abstract_params

    cfg = ArchConfig(architecture="Qwen2MoeForCausalLM", vocab_size=64, hidden_size=64,
                     intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=64, shared_expert_intermediate_size=64)
    params = abstract_params(cfg, "float32", _act_order_plan(permuted))
    tp = make_tensor_parallel(cfg, 2)
    if layer is None:
        specs = tp.param_specs(params)
        q = specs["layers"]["self_attn"]["q_proj"]
        assert q["qweight"][-1] is not None and q["perm"] == P()
        assert specs["layers"]["mlp"]["shared_expert"]["gate_proj"]["perm"] == P()
        return
    with pytest.raises(ValueError, match=rf"{layer}: an act-order q4 weight .* cannot be "
                                         r"split 2 ways along its input axis"):
        tp.param_specs(params)


@pytest.mark.slow(reason="a tensor-parallel engine over a checkpoint (compiles two models)")
def test_act_order_column_parallel_checkpoint_matches_one_device(smollm2_tokenizer, tmp_path):
    """A GPTQ act-order checkpoint whose row-parallel o_proj/down_proj keep their groups in
    order (no permutation) loads at tensor parallelism 2 shard by shard: the column-parallel
    layers split their sorted codes and keep the permutation whole; greedy tokens are the
    one-device engine's."""
    pytest.importorskip("torch")
    import torch

    from tests.models.helpers import QUANT_LLAMA
    from tests.models.int_packers import write_gptq_act_order

    hf, _ = write_gptq_act_order(tmp_path, QUANT_LLAMA,
                                 lambda base: not base.endswith(("o_proj", "down_proj")))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 128, n)]}
               for n in (5, 17, 9)]
    with torch.no_grad():  # transformers' greedy tokens on the dequantized weights
        want = [hf.generate(torch.tensor([p["prompt_token_ids"]]), max_new_tokens=12,
                            min_new_tokens=12, do_sample=False, pad_token_id=0)[
                                0, len(p["prompt_token_ids"]):].tolist() for p in prompts]
    tokens = {}
    for size in (1, 2):
        llm = LLM(str(tmp_path), tokenizer=smollm2_tokenizer, tensor_parallel_size=size,
                  warmup=False, **{**SMALL, "max_model_len": 64})
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                detokenize=False)
        tokens[size] = _tokens(llm.generate(prompts, greedy, use_tqdm=False))
        if size == 2:  # (one device serves from the CPU panels)
            q = llm.engine.runner.params["layers"]["self_attn"]["q_proj"]
            assert q["qweight"].sharding.spec[-1] is not None  # column split
            perm = q["perm"].sharding
            assert len(perm.device_set) == 2 and perm.is_fully_replicated
    assert tokens[2] == tokens[1] == want

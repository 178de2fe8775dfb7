"""Tensor parallelism over quantized weights and 8-bit KV pages: the one-device greedy tokens,
with codes, scales and zeros sharded like the float kernels they replace and the page pool
(codes and in-row scales) split on its KV-head axis."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.model import Model, random_params
from models.quant import QuantFormat, uniform_plan
from tests.parallel.test_parallel_engine import SMALL, TINY, _tiny_prompts, _tokens

GREEDY = SamplingParams(temperature=0, max_tokens=12, detokenize=False)
# 4-bit blocks of 32 and int8 per output channel: row-parallel o/down_proj split K, so at
# tp=4 a 64-wide K holds half a block per device (the scales are then replicated).
PLANS = {"q4": uniform_plan("q4", QuantFormat("q4", 32)),
         "int8": uniform_plan("int8", QuantFormat("q8", 0))}

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

    from jaxserve.parallel.sharding import make_tensor_parallel
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

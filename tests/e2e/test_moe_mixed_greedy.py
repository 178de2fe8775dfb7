"""Greedy generation of tiny random mixtures of experts whose layers mix sparse and dense
MLPs (`models.mixed`) through the engine equals transformers' `generate`: a Qwen2-MoE with
a dense middle layer (`mlp_only_layers`; shared expert in the sparse ones), and in the
slow tier a Qwen3-MoE with every other layer dense (`decoder_sparse_step`) and the
Qwen2-MoE under tensor parallelism."""

from __future__ import annotations

import pytest

from jaxserve import LLM
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, TINY, build_hf_model, check_engine_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The shared tiny-engine sizes; only the buckets these prompts use are compiled.
ENGINE_ARGS = {**TINY_ENGINE, "warmup": False}
MAX_TOKENS = 10
# 8 experts of 32, top 2; the dense layers' MLPs are 96 wide (TINY's intermediate_size).
MOE = dict(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
QWEN2 = dict(**MOE, num_hidden_layers=3, shared_expert_intermediate_size=48,
             mlp_only_layers=[1])
QWEN3 = dict(**MOE, num_hidden_layers=4, head_dim=16, norm_topk_prob=True,
             decoder_sparse_step=2)


@pytest.fixture(scope="module")
def qwen2_mixed(smollm2_tokenizer, tmp_path_factory):
    """(transformers model, our engine), saved with SmolLM2's tokenizer."""
    path = str(tmp_path_factory.mktemp("qwen2_moe_mixed"))
    hf = build_hf_model("Qwen2MoeConfig", "Qwen2MoeForCausalLM", QWEN2, smollm2_tokenizer,
                        path, norm_center=1.0)
    return hf, LLM(path, **ENGINE_ARGS)


def _ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


def test_qwen2_moe_mixed_greedy_matches_transformers(qwen2_mixed, smollm2_tokenizer):
    hf, llm = qwen2_mixed
    cfg = llm.engine.model.cfg
    assert (cfg.dense_layers, cfg.sparse_layers) == ((1,), (0, 2))
    assert type(hf.model.layers[1].mlp).__name__ == "Qwen2MoeMLP"  # the oracle's too
    check_engine_greedy(llm, hf, smollm2_tokenizer, _ids(smollm2_tokenizer), MAX_TOKENS)


@pytest.mark.slow  # the default case above serves mixed layers; this is the other field
def test_qwen3_moe_sparse_step_greedy_matches_transformers(smollm2_tokenizer, tmp_path):
    hf = build_hf_model("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3, smollm2_tokenizer,
                        str(tmp_path), norm_center=1.0)
    llm = LLM(str(tmp_path), **ENGINE_ARGS)
    assert llm.engine.model.cfg.dense_layers == (0, 2)
    check_engine_greedy(llm, hf, smollm2_tokenizer, _ids(smollm2_tokenizer), MAX_TOKENS)


@pytest.mark.slow  # another engine's programs on 2 devices
def test_qwen2_moe_mixed_under_tensor_parallelism(qwen2_mixed, smollm2_tokenizer):
    """Tensor parallelism 2: the dense layers' stack splits as a dense MLP, the shared
    expert too; the same tokens."""
    hf, served = qwen2_mixed
    llm = LLM(served.engine.model, tokenizer=smollm2_tokenizer,
              **{**ENGINE_ARGS, "tensor_parallel_size": 2})
    dense = llm.engine.runner.params["layers"]["dense_mlp"]["gate_proj"]["kernel"]
    assert len(dense.sharding.device_set) == 2
    check_engine_greedy(llm, hf, smollm2_tokenizer, _ids(smollm2_tokenizer)[:2], MAX_TOKENS)

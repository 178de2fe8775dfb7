"""Warm-up works when the token budget exceeds max_model_len (buckets longer than a sequence)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from models.config import ArchConfig
from models.model import Model, random_params

TINY = ArchConfig("LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=512, eos_token_ids=(2,))


@pytest.mark.slow
def test_budget_larger_than_max_model_len(smollm2_tokenizer):
    # NOTE: small sizes keep warm-up to two buckets (a budget of 1024 compiled eight). A
    # sequence holds 24 tokens (3 pages of 8), so the 32 bucket needs two dummy requests, the
    # second one shorter (24 + 8).
    llm = LLM(Model(TINY, random_params(TINY)), tokenizer=smollm2_tokenizer, block_size=8,
              max_model_len=24, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=64)
    assert llm.engine.runner.buckets == [4, 8, 16, 32]
    prompt = {"prompt_token_ids": list(range(3, 13))}  # 3 x 10 tokens: the 32 bucket
    outs = llm.generate([prompt] * 3, SamplingParams(temperature=0, max_tokens=4,
                                                     detokenize=False), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert len(tokens[0]) == 4 and tokens == [tokens[0]] * 3
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0

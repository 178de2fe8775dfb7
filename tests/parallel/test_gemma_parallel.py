"""A Gemma-shaped model (sandwich and q/k norms with `1 + weight`, soft caps, two rotary
bases, sliding and global layers) under tensor parallelism: the same greedy tokens as one
device. Its new parameters are norms, which the layout replicates."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.config import ArchConfig
from models.model import Model, random_params
from models.rope import RopeScaling

pytestmark = [pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices"),
              pytest.mark.slow]  # two engines' compiles; the layout is the Llama one's

GEMMA = ArchConfig("Gemma3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_layers=3, num_heads=8, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=512, eos_token_ids=(2,),
                   hidden_act="gelu_pytorch_tanh", norm_offset=1.0, embed_scale=True,
                   sandwich_norms=True, qk_norm=True, query_pre_attn_scalar=16.0,
                   attn_logit_softcap=2.0, final_logit_softcap=4.0, local_rope_theta=100.0,
                   rope_scaling=RopeScaling("linear", factor=8.0), layer_windows=(6, 6, 0))
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256, num_kv_blocks=64,
             warmup=False)


def test_gemma_tensor_parallel_matches_one_device(smollm2_tokenizer):
    params = jax.tree_util.tree_map(lambda x: x * 3.0, random_params(GEMMA, seed=3))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 256, n)]}
               for n in (5, 17, 33)]
    greedy = SamplingParams(temperature=0, max_tokens=12, detokenize=False)
    runs = []
    # One device with one block table, then the hybrid KV cache on one and two devices.
    for tp, plain in ((1, True), (1, False), (2, False)):
        llm = LLM(Model(GEMMA, params), tokenizer=smollm2_tokenizer, tensor_parallel_size=tp,
                  disable_hybrid_kv_cache_manager=plain, **SMALL)
        assert llm.engine.kv.num_groups == (1 if plain else 3)  # one full, two sliding
        runs.append([o.outputs[0].token_ids
                     for o in llm.generate(prompts, greedy, use_tqdm=False)])
        assert llm.engine.kv.usage == 0.0
    assert len(set(runs[0][1])) > 1
    assert runs[0] == runs[1] == runs[2]

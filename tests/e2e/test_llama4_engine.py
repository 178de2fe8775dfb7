"""Llama 4 through the engine beyond the conformance row: a long decode on the platform's own
backend (the "cpu" backend's C++ rows read each chunk through shifted tables) equals
transformers' greedy tokens, while its chunked layers' KV cache group holds only the current
chunk's pages (counted from the KV manager) and the NoPE layer's group one page per 8 tokens;
tensor and expert parallelism 2 give transformers' tokens. Slow: the default tier's Llama 4
numerics are tests/models/test_numerics.py's and tests/kernels/test_chunked_attention.py's."""

from __future__ import annotations

import jax
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, TINY, build_hf_model, hf_greedy, long_decode

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow(reason="Llama 4 engines and a 120-token transformers decode")

CHUNK, PAGE = 16, 8  # two pages per chunk
# Layers 0 and 2 chunked (rotary), 1 and 3 NoPE (full attention); layers 1 and 3 MoE.
CONFIG = dict(TINY, num_hidden_layers=4, head_dim=16, intermediate_size=32,
              intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
              interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=CHUNK,
              floor_scale=8, attn_scale=0.5,
              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16})
MAX_TOKENS = 120
ENGINE = {**TINY_ENGINE, "warmup": False, "block_size": PAGE, "max_num_batched_tokens": 16,
          "attention_backend": "auto"}


@pytest.fixture(scope="module")
def built(smollm2_tokenizer, tmp_path_factory):
    """(directory, the transformers model)."""
    path = str(tmp_path_factory.mktemp("llama4"))
    hf = build_hf_model("Llama4TextConfig", "Llama4ForCausalLM", CONFIG, smollm2_tokenizer,
                        path, norm_center=1.0)
    return path, hf


def test_long_decode_holds_only_the_current_chunk(built, smollm2_tokenizer):
    path, hf = built
    ids = smollm2_tokenizer(PROMPTS[0]).input_ids
    want = hf_greedy(hf, ids, MAX_TOKENS)
    llm = LLM(path, **ENGINE)
    engine, kv = llm.engine, llm.engine.kv
    assert sorted(kv.group_windows) == [-CHUNK, 0]
    chunked, full = kv.group_windows.index(-CHUNK), kv.group_windows.index(0)
    seen = long_decode(engine, ids, MAX_TOKENS)
    most, dropped = seen["most"], seen["first_kept"][chunked]
    assert seen["tokens"] == want
    length = len(ids) + MAX_TOKENS
    # A chunk's two pages and the one the next tokens open (the prompt's chunks of 16 at once).
    assert most[chunked] <= CHUNK // PAGE + 1 < most[full]
    assert most[full] >= (length - 1) // PAGE  # every token's page kept
    assert dropped >= ((length - 1) // CHUNK * CHUNK) // PAGE - 2  # the earlier chunks went back
    assert kv.usage == 0.0 and kv.pool.num_used_pages == 0


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(expert_parallel_size=2)], ids=["tp2", "ep2"])
def test_parallel_equals_transformers(built, smollm2_tokenizer, parallel):
    """TP 2 (heads, the dense and shared-expert MLPs and each expert's width split) and EP 2
    (two of the four experts per device) give transformers' tokens, batched, past a chunk."""
    path, hf = built
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    want = [hf_greedy(hf, x, 24) for x in ids]
    llm = LLM(path, **ENGINE, **parallel)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want

"""Greedy generation of a tiny random Phi-3 through the engine equals transformers'
`generate`: fused qkv/gate_up weights split at load, LongRoPE past the original context
with a partial rotary, and a sliding window shorter than the prompts."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import (
    PROMPTS,
    TINY,
    build_hf_model,
    check_engine_greedy,
    hf_greedy,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The shared tiny-engine sizes; only the buckets these prompts use are compiled.
ENGINE_ARGS = {**TINY_ENGINE, "warmup": False}
MAX_TOKENS = 12
ORIGINAL = 8  # the original context: every prompt is longer
# SmolLM2's vocabulary (49152, the tokenizer's); hidden 64, heads of 16 with half of each
# rotated (Phi-4-mini's partial rotary), a window of 8, an untied LM head.
CONFIG = dict(**TINY, num_hidden_layers=2, original_max_position_embeddings=ORIGINAL,
              partial_rotary_factor=0.5, sliding_window=8,
              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5,
                               "short_factor": [1.0, 1.2, 1.9, 3.0],
                               "long_factor": [1.3, 3.5, 8.0, 24.0]})


@pytest.fixture(scope="module")
def phi3(smollm2_tokenizer, tmp_path_factory):
    """(transformers model, our engine), saved with SmolLM2's tokenizer."""
    path = str(tmp_path_factory.mktemp("phi3"))
    hf = build_hf_model("Phi3Config", "Phi3ForCausalLM", CONFIG, smollm2_tokenizer, path,
                        norm_center=1.0)
    hf.local_path = path
    return hf, LLM(path, **ENGINE_ARGS)


def test_phi3_greedy_matches_transformers(phi3, smollm2_tokenizer):
    """transformers takes LongRoPE's long factors once a sequence passes the original
    context (its generate recomputes the cache there); every prompt here starts past it,
    so both run the long factors throughout, the engine's for its max_model_len (256)."""
    hf, llm = phi3
    cfg = llm.engine.model.cfg
    assert cfg.rope_scaling.use_long_factors and cfg.rotary_dim == 8
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    assert min(len(x) for x in ids) > max(ORIGINAL, CONFIG["sliding_window"])
    check_engine_greedy(llm, hf, smollm2_tokenizer, ids, MAX_TOKENS)


def test_a_short_max_model_len_serves_the_short_factors(phi3, smollm2_tokenizer):
    """An engine whose contexts never pass the original length runs LongRoPE's short
    factors, as transformers does for such sequences."""
    hf, _ = phi3
    llm = LLM(hf.local_path, **{**ENGINE_ARGS, "max_model_len": ORIGINAL})
    assert not llm.engine.model.cfg.rope_scaling.use_long_factors
    ids = smollm2_tokenizer("Once upon a").input_ids[:4]
    params = SamplingParams(temperature=0.0, max_tokens=ORIGINAL - len(ids), ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, ORIGINAL - len(ids))

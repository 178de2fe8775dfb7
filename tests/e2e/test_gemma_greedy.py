"""Greedy generation of tiny random Gemma 2 and Gemma 3 models through the engine equals
transformers' `generate` (sliding windows shorter than the prompts, soft caps that bind)."""

from __future__ import annotations

import pytest

from jaxserve import LLM
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import (
    PROMPTS,
    TINY,
    build_hf_model,
    check_engine_greedy,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The shared tiny-engine sizes; only the buckets these prompts use are compiled.
ENGINE_ARGS = {**TINY_ENGINE, "warmup": False}
MAX_TOKENS = 12
# Windows of 8 (shorter than the prompts); heads of 16.
BASE = dict(**TINY, head_dim=16, sliding_window=8)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=2, query_pre_attn_scalar=32,
                    attn_logit_softcapping=2.0, final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, query_pre_attn_scalar=16, sliding_window_pattern=3,
                    final_logit_softcapping=4.0,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 10000.0},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 100.0}})),
}


# The shared sizes' "xla" backend; the "cpu" backend (the C++ decode kernel with the soft
# cap, packed weights) in the slow tier, as the `cpu` backend's other engine runs.
@pytest.fixture(scope="module", params=[
    *FAMILIES, *(pytest.param(f"{f}-cpu", marks=pytest.mark.slow) for f in FAMILIES)])
def gemma(request, smollm2_tokenizer, tmp_path_factory):
    """(transformers model, our engine) of one tiny family, saved with SmolLM2's tokenizer."""
    family, _, backend = request.param.partition("-")
    config_cls, model_cls, extra = FAMILIES[family]
    path = str(tmp_path_factory.mktemp(family))
    hf = build_hf_model(config_cls, model_cls, {**BASE, **extra}, smollm2_tokenizer, path,
                        norm_center=0.0)  # norms away from their zero init: 1 + weight
    if backend == "cpu":
        from pallas_kernels import cpu_ffi

        if not cpu_ffi.available():
            pytest.skip(f"no CPU kernel here: {cpu_ffi.unavailable_reason()}")
    llm = LLM(path, **{**ENGINE_ARGS, "attention_backend": backend or "xla"})
    assert llm.engine.model.serving.backend == (backend or "xla")
    return hf, llm


def test_gemma_greedy_matches_transformers(gemma, smollm2_tokenizer):
    hf, llm = gemma
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    assert len(ids[0]) > 2 * BASE["sliding_window"]  # the window binds
    check_engine_greedy(llm, hf, smollm2_tokenizer, ids, MAX_TOKENS)

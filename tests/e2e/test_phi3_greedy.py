"""A tiny random Phi-3 whose contexts never pass LongRoPE's original length serves the short
factors, as transformers does. Its greedy tokens past that length (the long factors, fused
qkv/gate_up weights split at load, a partial rotary, a window shorter than the prompts) are
the phi3 row of tests/e2e/test_family_conformance.py (this file's model)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import build_hf_model, hf_greedy
from tests.e2e.test_family_conformance import family

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The shared tiny-engine sizes; only the buckets these prompts use are compiled.
ENGINE_ARGS = {**TINY_ENGINE, "warmup": False}
# The table's Phi-3: SmolLM2's vocabulary, hidden 64, heads of 16 with half of each rotated
# (Phi-4-mini's partial rotary), an original context of 8, a window of 8.
CONFIG = family("phi3").config
ORIGINAL = CONFIG["original_max_position_embeddings"]


@pytest.fixture(scope="module")
def phi3(smollm2_tokenizer, tmp_path_factory):
    """(transformers model, its directory), saved with SmolLM2's tokenizer."""
    path = str(tmp_path_factory.mktemp("phi3"))
    hf = build_hf_model("Phi3Config", "Phi3ForCausalLM", CONFIG, smollm2_tokenizer, path,
                        norm_center=1.0)
    return hf, path


def test_a_short_max_model_len_serves_the_short_factors(phi3, smollm2_tokenizer):
    """An engine whose contexts never pass the original length runs LongRoPE's short
    factors, as transformers does for such sequences."""
    hf, path = phi3
    llm = LLM(path, **{**ENGINE_ARGS, "max_model_len": ORIGINAL})
    assert not llm.engine.model.cfg.rope_scaling.use_long_factors
    ids = smollm2_tokenizer("Once upon a").input_ids[:4]
    params = SamplingParams(temperature=0.0, max_tokens=ORIGINAL - len(ids), ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, ORIGINAL - len(ids))

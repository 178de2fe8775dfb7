"""Greedy generation of tiny random Gemma 2 and Gemma 3 models on the `cpu` backend equals
transformers' `generate` (sliding windows shorter than the prompts, soft caps that bind).

Slow tier only: the default tier serves the same models on the "xla" backend in
tests/e2e/test_family_conformance.py (its gemma2 and gemma3 rows)."""

from __future__ import annotations

import pytest

from jaxserve import LLM
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, build_hf_model, check_engine_greedy
from tests.e2e.test_family_conformance import WINDOW, family

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The shared tiny-engine sizes; only the buckets these prompts use are compiled.
ENGINE_ARGS = {**TINY_ENGINE, "warmup": False}
MAX_TOKENS = 12
# The table's Gemma 2 and 3: windows of 8 (shorter than the prompts), heads of 16.
FAMILIES = ("gemma2", "gemma3")


# The "cpu" backend (the C++ decode kernel with the soft cap, packed weights) in the slow
# tier, as the `cpu` backend's other engine runs.
@pytest.fixture(scope="module", params=[
    pytest.param(f, id=f"{f}-cpu", marks=pytest.mark.slow) for f in FAMILIES])
def gemma(request, smollm2_tokenizer, tmp_path_factory):
    """(transformers model, our engine) of one tiny family, saved with SmolLM2's tokenizer."""
    from pallas_kernels import cpu_ffi

    row = family(request.param)
    path = str(tmp_path_factory.mktemp(row.name))
    hf = build_hf_model(row.config_cls, row.model_cls, row.config, smollm2_tokenizer, path,
                        norm_center=0.0)  # norms away from their zero init: 1 + weight
    if not cpu_ffi.available():
        pytest.skip(f"no CPU kernel here: {cpu_ffi.unavailable_reason()}")
    llm = LLM(path, **{**ENGINE_ARGS, "attention_backend": "cpu"})
    assert llm.engine.model.serving.backend == "cpu"
    return hf, llm


def test_gemma_greedy_matches_transformers(gemma, smollm2_tokenizer):
    hf, llm = gemma
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    assert len(ids[0]) > 2 * WINDOW  # the window binds
    check_engine_greedy(llm, hf, smollm2_tokenizer, ids, MAX_TOKENS)

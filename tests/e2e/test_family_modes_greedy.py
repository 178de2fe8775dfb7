"""Greedy tokens of the tiny random Mixtral, Qwen2-MoE (all sparse, shared expert), OLMoE,
Phi-3 (fused weights, LongRoPE, a window) and DeepSeek-V3 (latent pages, grouped sigmoid
routing, shared experts, a dense first layer) through an engine that preempts by recompute equal
transformers' `generate`: batched and alone, a prompt past the token budget (chunked
prefill), a prompt sent twice (prefix-cache hits), a pool too small for the batch and n-gram
speculation. The same under swap preemption, for every family, is
tests/e2e/test_family_conformance.py (these models are its rows); Qwen3-MoE's recompute
run is in tests/e2e/test_moe_greedy.py."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, build_hf_model, hf_greedy
from tests.e2e.test_family_conformance import family

torch = pytest.importorskip("torch")

FAMILIES = {name: family(name)
            for name in ("mixtral", "qwen2_moe", "olmoe", "phi3", "deepseek_v3")}
# A prompt of the family's own, after the others, whose greedy text repeats itself: the random
# DeepSeek-V3's continuations of PROMPTS and LONG end on a bigram seen before once in all (the
# n-gram speculator matches two tokens at least; its engine verified no proposal), while after
# this one transformers' text loops (" content ATP better" three times): proposals are made
# and some accepted.
REPEATING = {"deepseek_v3": "more and more and more"}
LONG = " ".join(["The three primary colors are red, yellow and blue; mixing two of them "
                 "gives a secondary color, and the painter knows"] * 4)
MAX_TOKENS = 24


@pytest.mark.slow  # five more engines; the default tier runs swap preemption (the table)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_greedy_under_recompute_preemption(name, smollm2_tokenizer, tmp_path):
    row = FAMILIES[name]
    hf = build_hf_model(row.config_cls, row.model_cls, row.config, smollm2_tokenizer,
                        str(tmp_path), 1.0)
    # NOTE: Phi-3's window gives pages back (the hybrid KV cache): a smaller pool preempts.
    blocks = 8 if name == "phi3" else 12
    llm = LLM(str(tmp_path), **{**TINY_ENGINE, "warmup": False, "num_kv_blocks": blocks,
                                "max_model_len": 128, "enable_prefix_caching": True,
                                "preemption_mode": "recompute",
                                "speculative_config": {"method": "ngram",
                                                       "num_speculative_tokens": 3}})
    assert llm.engine.model.cfg.num_experts == (0 if name == "phi3" else 8)
    llm.engine.speculator.gate.min_acceptance = 0.0  # proposals every step
    ids = [smollm2_tokenizer(p).input_ids for p in [*PROMPTS, LONG]]
    assert len(ids[-1]) > TINY_ENGINE["max_num_batched_tokens"]  # chunked prefill
    ids.append(list(ids[-1]))  # a prefix hit once the first copy's pages are cached
    if name in REPEATING:
        ids.append(smollm2_tokenizer(REPEATING[name]).input_ids)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [hf_greedy(hf, x, MAX_TOKENS) for x in ids]
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    for out, expected in zip(outs, want, strict=True):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 1  # not a degenerate repeat
        assert ours == expected, smollm2_tokenizer.decode(ours)
    alone = llm.generate([{"prompt_token_ids": ids[1]}], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == want[1]
    metrics = llm.get_metrics()
    assert metrics["jaxserve:num_preemptions"] > 0
    assert metrics["jaxserve:prefix_cache_hits"] > 0
    # Proposals were made and verified (accepted only where the random text repeats
    # itself, which Mixtral's here does not; Phi-3's never repeats an n-gram, so its
    # engine runs with the speculator but gets no proposal).
    if name != "phi3":
        assert metrics["jaxserve:spec_decode_num_draft_tokens"] > 0
    if name in REPEATING:  # its looping text: some proposals accepted
        assert metrics["jaxserve:spec_decode_num_accepted_tokens"] > 0

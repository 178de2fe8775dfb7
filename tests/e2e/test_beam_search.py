"""Beam search on the engine's forking: greedy at width 1, better scores, pages shared."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.beam_search import BeamSearchParams, beam_score

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(smollm2, smollm2_tokenizer):
    # NOTE: the serving tests' engine sizes (tests/entrypoints/conftest.py), pool included:
    # the programs its warm-up compiles are the server's, from the compilation cache.
    return LLM(smollm2, tokenizer=smollm2_tokenizer, max_num_seqs=8,
               max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=64)


def test_width_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=10))
    for g, b in zip(greedy, beams, strict=True):
        (best,) = b.sequences
        assert best.tokens[best.num_prompt_tokens:] == g.outputs[0].token_ids
        assert best.text == g.outputs[0].text


def test_wider_beams_score_at_least_greedy_and_share_pages(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, logprobs=0),
                          use_tqdm=False)
    cow_before = llm.get_metrics()["jaxserve:num_cow_copies"]
    results = llm.beam_search(PROMPTS, params)
    metrics = llm.get_metrics()
    assert metrics["jaxserve:num_cow_copies"] > cow_before  # forked beams diverged
    assert metrics["jaxserve:kv_cache_usage_perc"] == 0.0  # every beam's pages freed
    for g, r in zip(greedy, results, strict=True):
        seqs = r.sequences
        assert len(seqs) == 3
        assert len({tuple(s.tokens) for s in seqs}) == 3
        scores = [beam_score(len(s.tokens), s.cum_logprob, 1.0) for s in seqs]
        assert scores == sorted(scores, reverse=True)
        out = g.outputs[0]
        greedy_score = beam_score(len(g.prompt_token_ids) + len(out.token_ids),
                                  out.cumulative_logprob, 1.0)
        assert scores[0] >= greedy_score - 1e-4


def test_bad_params_raise(llm):
    with pytest.raises(ValueError, match="beam_width must be in"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width must be in"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="exceeds max_model_len 256"):
        llm.beam_search(["hi " * 200], BeamSearchParams(beam_width=2, max_tokens=100))
    assert llm.get_metrics()["jaxserve:kv_cache_usage_perc"] == 0.0

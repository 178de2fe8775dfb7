"""`LLMEngine.fork_request`: a request started from another's KV generates what the same
prompt does alone while computing only what it does not share; its refusals; and beam
search, built on it, giving the same beams when sequence slots and pages run short (beams
then wait apart: preempted, parked, continued without sharing)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.beam_search import BeamSearchParams
from models.loaders import load_model
from tests.conftest import TINY_ENGINE

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, "float32")


@pytest.fixture(scope="module")
def llm(model, smollm2_tokenizer):
    return LLM(model, tokenizer=smollm2_tokenizer, warmup=False, **TINY_ENGINE)


def _run(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def test_a_fork_generates_what_its_prompt_does_alone_from_the_shared_kv(llm):
    engine = llm.engine
    prompt = list(range(1000, 1021))  # 21 tokens: the fork shares a partly filled page
    engine.add_request("p", {"prompt_token_ids": prompt}, GREEDY)
    outputs = []
    while len(outputs) < 3:
        outputs += [t for out in engine.step() for t in out.outputs[0].token_ids[-1:]]
    forked = prompt + outputs[:2] + [4242]
    engine.fork_request("p", "c", {"prompt_token_ids": forked}, GREEDY)
    assert engine.scheduler.requests["c"].num_computed_tokens == len(forked) - 1
    cow_before = engine.get_metrics()["jaxserve:num_cow_copies"]
    got = _run(engine)
    assert engine.get_metrics()["jaxserve:num_cow_copies"] > cow_before
    assert engine.get_metrics()["jaxserve:kv_cache_usage_perc"] == 0.0
    engine.add_request("p-alone", {"prompt_token_ids": prompt}, GREEDY)
    engine.add_request("c-alone", {"prompt_token_ids": forked}, GREEDY)
    want = _run(engine)
    assert got == {"p": want["p-alone"], "c": want["c-alone"]}


def test_fork_refusals_queue_nothing(llm, model, smollm2_tokenizer):
    engine = llm.engine
    with pytest.raises(ValueError, match="no live request 'nobody'"):
        engine.fork_request("nobody", "c", [1, 2, 3], GREEDY)
    engine.add_request("p", [5, 6, 7, 8], GREEDY)
    with pytest.raises(ValueError, match="request id 'p' is already in use"):
        engine.fork_request("p", "p", [5, 6, 7, 9], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids hold ids outside"):
        engine.fork_request("p", "c", [5, 6, 7, 10**9], GREEDY)
    assert list(engine.states) == ["p"] and list(engine.scheduler.requests) == ["p"]
    engine.abort_request("p")
    pooling = LLM(model, tokenizer=smollm2_tokenizer, runner="pooling", warmup=False,
                  **TINY_ENGINE).engine
    pooling.add_request("e", [5, 6, 7, 8])
    with pytest.raises(ValueError, match="the pooling runner .* forks no requests"):
        pooling.fork_request("e", "c", [5, 6, 7, 9], GREEDY)


def test_beams_are_the_same_when_slots_and_pages_run_short(llm, model, smollm2_tokenizer):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    want = llm.beam_search(prompts, params)
    # 9 beams on 8 sequence slots and a pool of 6 pages of 16 tokens: beams wait for
    # slots, get preempted, and are continued without the pages they shared.
    short = LLM(model, tokenizer=smollm2_tokenizer, warmup=False,
                **{**TINY_ENGINE, "max_num_seqs": 8, "num_kv_blocks": 7})
    got = short.beam_search(prompts, params)
    metrics = short.get_metrics()
    assert metrics["jaxserve:num_preemptions"] > 0
    assert metrics["jaxserve:kv_cache_usage_perc"] == 0.0 and not short.engine.states
    for g, w in zip(got, want, strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx(
            [s.cum_logprob for s in w.sequences], abs=1e-4)

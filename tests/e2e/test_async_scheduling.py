"""Async scheduling (issue 11 item 4): each step is scheduled and dispatched while the
previous one runs, its placeholder tokens read from that step's samples on the device.
Outputs must equal synchronous stepping token for token, through chunked prefill,
preemption (recompute; swap in the slow tier), prefix-cache hits, stop strings and seeded
sampling.

The engine runs the tiny random model of tests/conftest.py (what is checked is the stepping,
not the weights): its stop strings are pieces of the text it writes greedily."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from models.loaders import load_model

SHARED = ("You are a helpful assistant. Answer briefly and precisely, in one sentence, "
          "and do not repeat the question. ")
PROMPTS = ["Once upon a time", SHARED + "Question: what is the capital of France?",
           "def fibonacci(n):", SHARED + "Question: name three fruits.",
           "The history of the city begins with a small fishing village on the river bank. "
           "Over the centuries, merchants arrived from distant lands, bringing spices, silk "
           "and new ideas. The village grew into a town with a market square.",
           "1, 2, 3, 4, 5,", SHARED + "Question: why is the sky blue?",
           "The three primary colors are"]


def params_of(i: int, stops: dict[int, str]) -> SamplingParams:
    """Greedy, seeded sampling, a stop string and different lengths, mixed in one batch."""
    if i % 3 == 0:
        return SamplingParams(temperature=0.0, max_tokens=12 + i)
    if i % 3 == 1:
        return SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=20,
                              ignore_eos=True)  # NOTE: its length never depends on the draws
    return SamplingParams(temperature=0.0, max_tokens=24, stop=[stops[i]])


@pytest.fixture(scope="module", params=["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def llm(request, tiny_model_dir, smollm2_tokenizer) -> LLM:
    # A 15-page pool (16 tokens each) cannot hold the batch: requests are preempted.
    return LLM(load_model(tiny_model_dir, "float32"), tokenizer=smollm2_tokenizer,
               max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=16,
               attention_backend="xla", warmup=False, preemption_mode=request.param,
               swap_space=0.05)


@pytest.fixture(scope="module")
def stops(llm) -> dict[int, str]:
    """{i: a stop string} for the stop-string requests: three characters from the middle of
    the text each writes greedily without one, so it stops there (or earlier)."""
    ids = [i for i in range(len(PROMPTS)) if i % 3 == 2]
    outs = llm.generate([PROMPTS[i] for i in ids],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    found = {}
    for i, out in zip(ids, outs, strict=True):
        text = out.outputs[0].text
        start = next(j for j in range(len(text) // 2, len(text) - 3)
                     if text[j:j + 3].strip() and "\ufffd" not in text[j:j + 3])
        found[i] = text[start:start + 3]
    return found


def run(llm: LLM, stops: dict[int, str], overlap: bool):
    """Each request's (token ids, text, finish reason), the step counts (overlapped, all)
    and the metrics gained, from a cold prefix cache: the batch twice, so the second round
    hits the pages of the first."""
    engine = llm.engine
    engine.async_scheduling = overlap
    engine.kv.evict_cached_pages()
    before = llm.get_metrics()
    counts = {"overlapped": 0, "all": 0}
    dispatch = engine.runner.dispatch

    def counting(*args, prev=None, **kwargs):
        counts["all"] += 1
        counts["overlapped"] += prev is not None
        return dispatch(*args, prev=prev, **kwargs)

    engine.runner.dispatch = counting
    try:
        results = []
        for _ in range(2):
            outs = llm.generate(PROMPTS, [params_of(i, stops) for i in range(len(PROMPTS))],
                                use_tqdm=False)
            results += [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                        for o in outs]
    finally:
        del engine.runner.dispatch
    after = llm.get_metrics()
    gained = {k: after[k] - before[k] for k in ("jaxserve:num_preemptions",
                                                "jaxserve:prefix_cache_hits",
                                                "jaxserve:num_swap_outs")}
    assert after["jaxserve:kv_cache_usage_perc"] == 0.0
    return results, counts, gained


def test_overlapped_steps_give_the_same_outputs_as_synchronous_ones(llm, stops):
    sync, sync_counts, sync_gained = run(llm, stops, overlap=False)
    overlapped, counts, gained = run(llm, stops, overlap=True)
    assert sync_counts["overlapped"] == 0
    # Most steps overlap the one before (not those after a prompt's first token is
    # sampled with n > 1, nor the first of each round).
    assert counts["overlapped"] >= 0.6 * counts["all"], counts
    for got, want in zip(overlapped, sync, strict=True):
        assert got == want
    for figures in (sync_gained, gained):
        assert figures["jaxserve:num_preemptions"] > 0
        assert figures["jaxserve:prefix_cache_hits"] > 0
        swapped = figures["jaxserve:num_swap_outs"] > 0
        assert swapped == (llm.engine.config.scheduler.preemption_mode == "swap")
    assert {reason for _, _, reason in sync} == {"stop", "length"}


def test_a_penalty_request_makes_steps_synchronous_while_it_runs(llm):
    """Sampling with penalties reads the tokens before it, so no step overlaps while such a
    request runs; its neighbours' outputs are unchanged."""
    engine = llm.engine
    engine.async_scheduling = True
    prompts = PROMPTS[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=1.5),
              *[SamplingParams(temperature=0.0, max_tokens=8)] * 2]
    overlaps = []
    dispatch = engine.runner.dispatch

    def recording(*args, prev=None, **kwargs):
        overlaps.append(prev is not None)
        return dispatch(*args, prev=prev, **kwargs)

    engine.runner.dispatch = recording
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.runner.dispatch
    # The penalty request is admitted (with the others) by the first step and runs to the
    # end, so every step after the first waits for the one before.
    assert not any(overlaps)
    engine.async_scheduling = False
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_abort_while_a_step_is_in_flight_frees_everything(llm):
    engine = llm.engine
    engine.async_scheduling = True
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"a{i}", prompt, params)
    outputs = []
    for _ in range(3):
        outputs += engine.step()
    assert engine._pending is not None  # a step is on the device now
    (final,) = engine.abort_request("a1")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        outputs += engine.step()
    done = {o.request_id: o for o in outputs if o.finished}
    assert sorted(done) == ["a0", "a2", "a3"]
    assert all(len(o.outputs[0].token_ids) == 30 for o in done.values())
    assert engine.kv.usage == 0.0


def test_an_id_reused_after_an_abort_in_flight_starts_afresh(llm):
    """Aborting while a step is in flight, then adding new requests under the same ids: the
    step's late samples must not reach the new requests (it once left them a placeholder
    count of -1, and they were never scheduled)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.async_scheduling = False
    expected = [o.outputs[0].token_ids
                for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)]
    engine.async_scheduling = True
    for round_ in range(2):
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"same{i}", prompt, params)
        outputs = []
        if round_ == 0:
            for _ in range(4):
                outputs += engine.step()
            assert engine._pending is not None  # a step is on the device now
            engine.abort_request([f"same{i}" for i in range(3)])
            continue
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            outputs += engine.step()
        done = {o.request_id: o.outputs[0].token_ids for o in outputs if o.finished}
        assert [done.get(f"same{i}") for i in range(3)] == expected
    assert engine.kv.usage == 0.0

"""When the engine emits outputs (`SamplingParams.output_kind`, vLLM's RequestOutputKind):
CUMULATIVE snapshots, DELTA increments that add up to the same result, FINAL_ONLY once at
the end with the same text (detokenized at the end when no stop string is watched)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.sampling_params import RequestOutputKind as Kind
from tests.conftest import TINY_ENGINE

# The shared tiny-engine sizes: the programs come from the persistent compilation cache.
ENGINE_ARGS = {**TINY_ENGINE, "warmup": False}
PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, **ENGINE_ARGS)


def run(llm, params: SamplingParams, prompts=PROMPTS, abort_after: int | None = None):
    """{request_id: [outputs in order]} of stepping the engine over `prompts`."""
    eng = llm.engine
    ids = [f"{params.output_kind.name}-{i}-{id(params)}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        eng.add_request(rid, prompt, params)
    got = {rid: [] for rid in ids}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id].append(out)
        steps += 1
        if abort_after is not None and steps == abort_after:
            for out in eng.abort_request(ids):
                got[out.request_id].append(out)
    return [got[rid] for rid in ids]


def joined(deltas, index=0):
    """(token ids, text, logprobs) of completion `index` put together from DELTA outputs."""
    tokens, text, logprobs = [], "", []
    for out in deltas:
        for comp in out.outputs:
            if comp.index == index:
                tokens += comp.token_ids
                text += comp.text
                logprobs += comp.logprobs or []
    return tokens, text, logprobs


def final(outs, index=0):
    comp = next(c for c in outs[-1].outputs if c.index == index)
    return comp.token_ids, comp.text, comp.logprobs or [], comp.finish_reason


@pytest.mark.parametrize("extra", [
    dict(temperature=0.0, max_tokens=12, logprobs=2),
    dict(temperature=1.0, seed=7, n=2, max_tokens=10),
    dict(temperature=0.0, max_tokens=12, skip_special_tokens=False),
])
def test_delta_and_final_only_add_up_to_cumulative(llm, extra):
    cumulative = run(llm, SamplingParams(**extra))
    delta = run(llm, SamplingParams(**extra, output_kind=Kind.DELTA))
    final_only = run(llm, SamplingParams(**extra, output_kind=Kind.FINAL_ONLY))
    for c, d, f in zip(cumulative, delta, final_only, strict=True):
        assert len(c) > 2 and len(d) == len(c)  # one per step in both
        assert len(f) == 1 and f[0].finished  # once, at the end
        assert [o.finished for o in d] == [False] * (len(d) - 1) + [True]
        for index in range(extra.get("n", 1)):
            tokens, text, logprobs, reason = final(c, index)
            assert joined(d, index) == (tokens, text, logprobs)
            assert final(f, index) == (tokens, text, logprobs, reason)
            assert reason == "length" and text
        # Each DELTA output holds only what is new: no token is sent twice.
        assert sum(len(comp.token_ids) for o in d for comp in o.outputs) == \
            sum(len(comp.token_ids) for comp in c[-1].outputs)


def test_prompt_logprobs_come_once_in_delta(llm):
    delta = run(llm, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1,
                                    output_kind=Kind.DELTA), prompts=PROMPTS[:1])[0]
    cumulative = run(llm, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1),
                     prompts=PROMPTS[:1])[0]
    assert delta[0].prompt_logprobs == cumulative[-1].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in delta[1:])


def test_delta_never_sends_text_a_stop_string_takes_back(llm):
    ref = run(llm, SamplingParams(temperature=0.0, max_tokens=16), prompts=PROMPTS[:1])[0]
    text = final(ref)[1]
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a stop string the output will hit
    assert len(stop) == 3
    params = dict(temperature=0.0, max_tokens=16, stop=[stop])
    cumulative = run(llm, SamplingParams(**params), prompts=PROMPTS[:1])[0]
    delta = run(llm, SamplingParams(**params, output_kind=Kind.DELTA), prompts=PROMPTS[:1])[0]
    final_only = run(llm, SamplingParams(**params, output_kind=Kind.FINAL_ONLY),
                     prompts=PROMPTS[:1])[0]
    tokens, want, _, reason = final(cumulative)
    assert reason == "stop" and stop not in want
    sent = ""
    for out in delta:
        sent += "".join(c.text for c in out.outputs)
        assert want.startswith(sent)  # never text that the stop string later cuts
    assert sent == want and joined(delta)[0] == tokens
    assert final(final_only)[:2] == (tokens, want) and final(final_only)[3] == "stop"


def test_text_at_end_matches_step_by_step_text_when_a_stop_token_ends_it(llm):
    ref = run(llm, SamplingParams(temperature=0.0, max_tokens=12), prompts=PROMPTS[1:2])[0]
    stop_id = final(ref)[0][5]
    for include in (False, True):
        params = dict(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id],
                      include_stop_str_in_output=include)
        step_text = final(run(llm, SamplingParams(**params), prompts=PROMPTS[1:2])[0])
        end_text = final(run(llm, SamplingParams(**params, output_kind=Kind.FINAL_ONLY),
                             prompts=PROMPTS[1:2])[0])
        assert end_text == step_text and step_text[3] == "stop"


def test_aborted_final_only_request_has_the_text_so_far(llm):
    params = dict(temperature=0.0, max_tokens=40)
    cumulative = run(llm, SamplingParams(**params), abort_after=4)
    final_only = run(llm, SamplingParams(**params, output_kind=Kind.FINAL_ONLY), abort_after=4)
    for c, f in zip(cumulative, final_only, strict=True):
        assert len(f) == 1 and f[0].outputs[0].finish_reason == "abort"
        assert final(f) == final(c) and final(f)[1]


def test_generate_uses_final_only_and_gives_the_cumulative_result(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    ref = run(llm, params)
    assert [final([o]) for o in outs] == [final(r) for r in ref]
    assert params.output_kind == Kind.CUMULATIVE  # the caller's object is left as it was
    assert llm.engine.kv.stats().usage == 0.0

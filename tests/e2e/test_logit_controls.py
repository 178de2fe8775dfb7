"""logit_bias, allowed_token_ids and bad_words through the engine (a tiny random model with
SmolLM2's tokenizer): what they promise holds, nothing compiles after warm-up, bad ids are
refused at add without touching other requests."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE

ENGINE_ARGS = TINY_ENGINE
PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, **ENGINE_ARGS)  # warmed up: every sampler variant compiled


def tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_logit_bias_steers_every_token(llm):
    target = 28
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                logit_bias={target: 100.0}), use_tqdm=False)
    assert all(t == [target] * 6 for t in tokens(outs))
    ref = tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6),
                              use_tqdm=False))
    first = {t[0] for t in ref}
    pushed = llm.generate(PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=6, logit_bias={t: -100.0 for t in first}), use_tqdm=False)
    assert all(t[0] not in first for t in tokens(pushed))
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


@pytest.mark.parametrize("extra", [dict(temperature=0.0), dict(temperature=1.0, seed=5, n=2)])
def test_allowed_token_ids_are_the_only_ones_sampled(llm, extra):
    allowed = [28, 260, 2240, 11, 13]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, allowed_token_ids=allowed,
                                                ignore_eos=True, **extra), use_tqdm=False)
    got = tokens(outs)
    assert all(set(t) <= set(allowed) and len(t) == 8 for t in got)
    assert len({x for t in got for x in t}) > 1
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


def test_bad_words_never_appear(llm):
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12),
                       use_tqdm=False)
    words = sorted({w for o in ref for w in o.outputs[0].text.split() if w.isalpha()})[:4]
    assert words, [o.outputs[0].text for o in ref]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                bad_words=words), use_tqdm=False)
    seqs = llm.engine.inputs.bad_words_token_ids(words)
    for out in outs:
        ids = out.outputs[0].token_ids
        for seq in seqs:
            assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (seq, ids)
    assert tokens(outs) != tokens(ref)
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


@pytest.mark.parametrize("params, field", [
    (SamplingParams(logit_bias={49152: 1.0}), "logit_bias"),
    (SamplingParams(allowed_token_ids=[5, 10**6]), "allowed_token_ids"),
    (SamplingParams(bad_words=[f"word{i}" for i in range(40)]), "bad_words"),
    (SamplingParams(allowed_token_ids=[7, 9], stop_token_ids=[7, 9], min_tokens=2),
     "allowed_token_ids"),
    (SamplingParams(bad_words=[f"w{i}" for i in range(30)], min_tokens=1,
                    stop_token_ids=list(range(10))), "bad_words"),
])
def test_ids_outside_the_vocabulary_are_refused_at_add(llm, params, field):
    eng = llm.engine
    eng.add_request("neighbour", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))
    with pytest.raises(ValueError, match=field):
        eng.add_request("bad", PROMPTS[1], params)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["neighbour"]
    assert eng.kv.stats().usage == 0.0

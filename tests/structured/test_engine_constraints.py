"""Structured outputs through the engine (a tiny random model with SmolLM2's tokenizer, so
its unconstrained text is noise): every constrained output satisfies its constraint, free
requests in the same steps are unchanged, nothing compiles after warm-up."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from tests.conftest import TINY_ENGINE
from tests.structured import SCHEMA

# NOTE: the shared tiny-engine sizes (and XLA attention): the warm-up's programs are those
# of the other tiny engines (tests/e2e), loaded from the compilation cache.
ENGINE_ARGS = TINY_ENGINE
PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):",
           "List three fruits:"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, **ENGINE_ARGS)


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def test_json_schema_outputs_validate(llm):
    # NOTE: compact JSON: a random model picks whitespace whenever it may.
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=200, structured_outputs=so)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for text in texts(outs):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts(outs))) > 1
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


@pytest.mark.parametrize("constraint, check", [
    (dict(regex=r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"),
     lambda t: re.fullmatch(r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", t)),
    (dict(choice=["yes", "no", 'say "maybe"\\n']),
     lambda t: t in ("yes", "no", 'say "maybe"\\n')),
    (dict(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'),
     lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", t)),
    (dict(grammar='root ::= "ab" digit digit? ("," | "!")\ndigit ::= [0-9]'),
     lambda t: re.fullmatch(r"ab[0-9]{1,2}[,!]", t)),
])
def test_regex_choice_grammar_outputs_match(llm, constraint, check):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(**constraint))
    got = texts(llm.generate(PROMPTS, params, use_tqdm=False))
    assert all(check(t) for t in got), got


def test_free_requests_unchanged_beside_constrained(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = texts(llm.generate(PROMPTS, free, use_tqdm=False))
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z ]{30}"))
    mixed = llm.generate(PROMPTS * 2, [free] * len(PROMPTS) + [constrained] * len(PROMPTS),
                         use_tqdm=False)
    assert texts(mixed)[:len(PROMPTS)] == alone
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


@pytest.mark.slow
def test_logprobs_and_preemption_keep_constrained_outputs(llm, tiny_model_dir):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=120, logprobs=2, structured_outputs=so)
    want = llm.generate(PROMPTS * 2, params, use_tqdm=False)
    for o in want:
        c = o.outputs[0]
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert len(c.logprobs) == len(c.token_ids)
        assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True))
    # 24 pages of 16 tokens cannot hold eight ~130-token requests at once: preemption
    # (recompute) rebuilds their KV; the matchers keep following the same tokens.
    small = LLM(tiny_model_dir, warmup=False, **{**ENGINE_ARGS, "num_kv_blocks": 24})
    got = small.generate(PROMPTS * 2, params, use_tqdm=False)
    assert small.get_metrics()["jaxserve:num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_unsatisfiable_request_fails_alone(llm):
    """`choice=["a"]` with min_tokens=3: after "a" the grammar allows only EOS, which
    min_tokens bans, so the request cannot continue: it ends with an error, and the
    requests beside it are untouched."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = texts(llm.generate(PROMPTS, free, use_tqdm=False))
    stuck = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3,
                           structured_outputs=StructuredOutputsParams(choice=["a"]))
    outs = llm.generate(PROMPTS + PROMPTS[:1], [free] * len(PROMPTS) + [stuck],
                        use_tqdm=False)
    assert texts(outs)[:len(PROMPTS)] == alone
    assert outs[-1].outputs[0].finish_reason == "error"
    assert llm.get_metrics()["jaxserve:kv_cache_usage_perc"] == 0  # no page leaks


def test_ignore_eos_runs_on_after_the_grammar_completes(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    eos = llm.get_tokenizer().eos_token_id
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 6
        assert c.text in ("yes", "no") and c.token_ids[-1] == eos


@pytest.mark.parametrize("bad, words", [
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}),
     "does not exist"),
    (dict(regex="(ab"), "does not compile"),
    (dict(grammar="start: undefined_rule"), "does not compile"),
])
def test_bad_constraints_are_refused_at_add(llm, bad, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**bad)),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

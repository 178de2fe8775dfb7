"""N-gram speculation against the same engine settings without it (the tiny random model in
the default tier, SmolLM2 in the slow tier, which adds the checks that need real text:
seeded sampling with accepted proposals, stop strings): logprobs, n > 1, penalties and
structured outputs give the same outputs; metrics add up; nothing compiles after warm-up;
bad configurations are refused."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.beam_search import BeamSearchParams

ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                   num_kv_blocks=64, enable_prefix_caching=False, attention_backend="xla")
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
# Continuations that copy spans of their prompts, so proposals are made and accepted.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3
    + "Repeat the sentence above exactly: The quick brown fox",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "Alice said: 'I will be there at noon.' Bob asked what Alice said. Alice said: '",
    "red, green, blue, red, green, blue, red, green,",
]


# NOTE: a 16-token budget for the tiny model: the warmed-up engine compiles three token
# buckets, where 64 tokens make five (the long prompts then chunk, and a step's verification
# rows can outgrow the budget).
TINY_ARGS = {**ENGINE_ARGS, "max_num_batched_tokens": 16}


# NOTE: the tiny random model (tied: its text repeats, so proposals hold) in the default
# tier; SmolLM2's real text in the slow tier (its warmed-up engine compiles for a minute).
@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def target(request) -> tuple:
    """(model or path, tokenizer or None, which, engine arguments)."""
    if request.param == "tiny":
        return request.getfixturevalue("tiny_model_dir"), None, "tiny", TINY_ARGS
    return (request.getfixturevalue("smollm2"), request.getfixturevalue("smollm2_tokenizer"),
            "smollm2", ENGINE_ARGS)


@pytest.fixture(scope="module")
def base(target) -> LLM:
    model, tokenizer, _, args = target
    return LLM(model, tokenizer=tokenizer, warmup=False, **args)


@pytest.fixture(scope="module")
def spec(target) -> LLM:
    """Warmed up, so that the test can assert nothing compiles afterwards."""
    model, tokenizer, _, args = target
    return LLM(model, tokenizer=tokenizer, speculative_config=SPEC, **args)


def run(llm: LLM, params) -> list:
    return [o.outputs for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    m = llm.get_metrics()
    return (m["jaxserve:spec_decode_num_drafts"], m["jaxserve:spec_decode_num_draft_tokens"],
            m["jaxserve:spec_decode_num_accepted_tokens"])


def test_seeded_sampling_keeps_its_tokens(base, spec, target):
    """Each verified position draws with its output position's seed and counter, so a
    seeded request samples the same tokens with and without proposals."""
    if target[2] != "smollm2":
        # NOTE: the random model's sampled text never repeats, so no n-gram proposal would
        # be checked; tests/spec_decode/test_draft_model.py verifies seeded samples against
        # the tiny model's draft proposals in the default tier.
        pytest.skip("sampled proposals need SmolLM2's text")
    before = spec_counts(spec)
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=100 + i, max_tokens=24)
              for i in range(len(PROMPTS))]
    want = [[c.token_ids for c in outs] for outs in run(base, params)]
    got = [[c.token_ids for c in outs] for outs in run(spec, params)]
    assert got == want
    after = spec_counts(spec)
    assert after[2] > before[2]  # some proposals held under sampling too


def test_greedy_logprobs_of_accepted_tokens(base, spec):
    """Every token (proposal or not) carries its own position's logprob and top-3."""
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3)
    for want, got in zip(run(base, params), run(spec, params), strict=True):
        w, g = want[0], got[0]
        assert g.token_ids == w.token_ids
        assert len(g.logprobs) == len(g.token_ids)
        for lw, lg in zip(w.logprobs, g.logprobs, strict=True):
            assert lg.keys() == lw.keys()
            for tid in lw:
                assert lg[tid].logprob == pytest.approx(lw[tid].logprob, abs=1e-4)
                assert lg[tid].rank == lw[tid].rank
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


def test_stop_string_inside_accepted_tokens(base, spec, target):
    """A stop string completed by an accepted proposal ends the output at that token."""
    if target[2] != "smollm2":
        pytest.skip("the stop strings are SmolLM2's text")
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=["lazy", "print(k"])
    for want, got in zip(run(base, params), run(spec, params), strict=True):
        assert (got[0].token_ids, got[0].text, got[0].finish_reason, got[0].stop_reason) \
            == (want[0].token_ids, want[0].text, want[0].finish_reason, want[0].stop_reason)
    assert run(spec, params)[0][0].stop_reason == "lazy"


def test_n_samples_and_penalties(base, spec):
    """Fan-out children speculate on their own; penalties see the proposals before each
    position as output already."""
    params = [SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=16),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=16),
              SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3,
                             max_tokens=16),
              SamplingParams(temperature=0.0, min_tokens=12, max_tokens=14)]
    want = [[c.token_ids for c in outs] for outs in run(base, params)]
    got = [[c.token_ids for c in outs] for outs in run(spec, params)]
    assert got == want
    assert len(got[0]) == 2


def test_metrics_add_up_and_nothing_compiles(spec):
    """Per-position acceptance is non-increasing and sums to the accepted count; no step
    of the runs above compiled (warm-up covered the verification rows)."""
    m = spec.get_metrics()
    drafts, draft_tokens, accepted = spec_counts(spec)
    per_pos = [m[f"jaxserve:spec_decode_num_accepted_tokens_per_pos{{position={i}}}"]
               for i in range(SPEC["num_speculative_tokens"])]
    assert 0 < accepted <= draft_tokens <= 3 * drafts
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)
    assert per_pos[0] <= drafts
    assert m["jaxserve:num_compilations"] == 0
    assert m["jaxserve:kv_cache_usage_perc"] == 0.0


def test_max_tokens_is_never_passed(spec):
    """Proposals that would run past max_tokens are not verified."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert all(len(outs[0].token_ids) == 5 for outs in run(spec, params))


def test_beam_search_refuses_a_speculating_engine(spec):
    with pytest.raises(ValueError, match="speculative_config"):
        spec.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=4))


@pytest.mark.parametrize("config,field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ("{not json", "speculative_config"),
])
def test_bad_configs_name_the_field(smollm2, smollm2_tokenizer, config, field):
    with pytest.raises(ValueError, match=field):
        LLM(smollm2, tokenizer=smollm2_tokenizer, warmup=False, speculative_config=config,
            **ENGINE_ARGS)


def test_structured_outputs_under_speculation(base, spec, target):
    """Each verified position gets the mask of the grammar after the proposals before it
    (proposals the grammar rejects, as the code prompt's newlines, are never kept): the
    tokens are those of the engine without speculation, and they follow the regex."""
    import re

    from jaxserve import StructuredOutputsParams

    if target[2] != "smollm2":
        pytest.skip("the random model's masked text never repeats: no proposal to check")

    pattern = r"[A-Za-z ,.':]{1,60}"
    before = spec_counts(spec)
    params = [SamplingParams(temperature=t, seed=7 + i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=pattern))
              for i, t in enumerate([0.0, 0.0, 0.7, 0.0])]
    want = [[c.token_ids for c in outs] for outs in run(base, params)]
    got_outs = run(spec, params)
    assert [[c.token_ids for c in outs] for outs in got_outs] == want
    assert all(re.fullmatch(pattern, outs[0].text) for outs in got_outs), got_outs
    assert spec_counts(spec)[2] > before[2]  # proposals were accepted under the mask
    assert spec.get_metrics()["jaxserve:num_compilations"] == 0

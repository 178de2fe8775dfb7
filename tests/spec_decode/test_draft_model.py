"""Draft-model speculation: greedy outputs equal the engine's without it (chunked, preempted),
a draft identical to the target has its proposals accepted (its KV is kept right across
steps), a bad draft leaves the sampled distribution the target's, and bad drafts are refused.

The default tier runs the parity checks on the tiny random model (what is checked is the
verification and the draft's KV, not the weights); SmolLM2 runs them in the slow tier and
for the distribution check, which needs a real model's distribution."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.spec_decode.draft import truncate_layers
from models.loaders import load_model
from models.model import Model

ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                   num_kv_blocks=64, enable_prefix_caching=False, attention_backend="xla",
                   warmup=False)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3 + "Repeat it: The quick brown fox",
    "def fibonacci(n):",
    "The history of the city begins with a small fishing village on the river bank. Over "
    "the centuries, merchants arrived from distant lands, bringing spices, silk and new "
    "ideas. In summary, the city's story is one of",
    "Once upon a time",
    "1, 2, 3, 4, 5,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
# The tiny model's engines run on a 9-page pool (requests are preempted and recomputed), the
# size of the truncated draft's "recompute" case: its target programs are then the ones the
# reference and self-draft engines compiled (the persistent compilation cache).
# NOTE: and a 16-token budget: three token buckets to compile where 64 tokens make five (16
# compiles for the two default-tier engines instead of 22; the file's CPU time 51-54 s -> 45 s
# from an empty cache); the long prompts are then chunked too.
TINY_ARGS = {**ENGINE_ARGS, "num_kv_blocks": 9, "preemption_mode": "recompute",
             "max_num_batched_tokens": 16}


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Chi-square critical value at p = 0.001 (z = 3.09), Wilson-Hilferty: within 3% of the
    tables (11.16 for 10.83 at 1 degree of freedom, 29.76 for 29.59 at 10)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


def draft_config(draft, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def base(smollm2, smollm2_tokenizer) -> LLM:
    return LLM(smollm2, tokenizer=smollm2_tokenizer, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def want(base) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in base.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Model:
    """The conftest's tiny random Llama (2 layers, SmolLM2's vocabulary)."""
    return load_model(tiny_model_dir, "float32")


@pytest.fixture(scope="module")
def tiny_want(tiny, smollm2_tokenizer) -> list[list[int]]:
    return token_ids(LLM(tiny, tokenizer=smollm2_tokenizer, **TINY_ARGS))


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def target(request, smollm2_tokenizer) -> tuple[Model, list[list[int]], dict]:
    """(a target model, its greedy tokens without speculation, its engine's arguments): the
    tiny model in the default tier, SmolLM2 in the slow one."""
    if request.param == "tiny":
        return request.getfixturevalue("tiny"), request.getfixturevalue("tiny_want"), TINY_ARGS
    return request.getfixturevalue("smollm2"), request.getfixturevalue("want"), ENGINE_ARGS


def token_ids(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def acceptance(llm: LLM) -> float:
    m = llm.get_metrics()
    assert m["jaxserve:spec_decode_num_drafts"] > 0
    return m["jaxserve:spec_decode_num_accepted_tokens"] / m[
        "jaxserve:spec_decode_num_draft_tokens"]


@pytest.mark.slow  # the draft path's tokens are checked by the parity test; this, its rate
def test_self_draft_is_accepted(target, smollm2_tokenizer):
    """The target as its own draft: every proposal is the target's greedy token, so all
    are accepted unless the draft's KV went wrong between steps (catch-up, proposals'
    slots written again)."""
    model, want, args = target
    llm = LLM(model, tokenizer=smollm2_tokenizer, speculative_config=draft_config(model),
              **args)
    assert token_ids(llm) == want
    assert acceptance(llm) > 0.95


@pytest.mark.parametrize("overrides", [
    pytest.param({"max_num_batched_tokens": 16}, id="chunk16", marks=pytest.mark.slow),
    pytest.param({"num_kv_blocks": 9, "preemption_mode": "recompute"}, id="recompute"),
    pytest.param({"num_kv_blocks": 9, "preemption_mode": "swap"}, id="swap",
                 marks=pytest.mark.slow),
    pytest.param({"attention_backend": "pallas"}, id="pallas", marks=pytest.mark.slow),
])
def test_truncated_draft_greedy_parity(target, smollm2_tokenizer, overrides):
    """A 1-layer copy proposes (mostly wrongly); outputs are the target's under chunking,
    preemption and the Pallas kernels (the target's; the draft keeps its XLA attention)."""
    model, want, args = target
    llm = LLM(model, tokenizer=smollm2_tokenizer,
              speculative_config=draft_config(truncate_layers(model, 1), k=2),
              **{**args, **overrides})
    llm.engine.speculator.gate.min_acceptance = 0.0  # verify every step, though it never pays
    assert token_ids(llm) == want
    acceptance(llm)
    metrics = llm.get_metrics()
    if "num_kv_blocks" in overrides:
        assert metrics["jaxserve:num_preemptions"] > 0
    assert metrics["jaxserve:kv_cache_usage_perc"] == 0.0


@pytest.mark.slow
def test_bad_draft_keeps_the_target_distribution(smollm2, smollm2_tokenizer, tiny_model_dir,
                                                 base):
    """Temperature 1 with a random tiny draft (loaded by path): the second token, given the
    most frequent first one, follows the target's own distribution (chi-square over the
    target's top tokens), and each seeded request samples what it samples without a draft.
    """
    prompt = "The capital of France is"
    num = 240
    llm = LLM(smollm2, tokenizer=smollm2_tokenizer, speculative_config=draft_config(
        tiny_model_dir, k=3), **{**ENGINE_ARGS, "max_num_seqs": 16})
    llm.engine.speculator.gate.min_acceptance = 0.0  # verify every proposal, however bad
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(num)]
    got = token_ids_of(llm, prompt, params)
    assert llm.get_metrics()["jaxserve:spec_decode_num_draft_tokens"] >= num
    firsts = np.array([g[0] for g in got])
    t0 = int(np.bincount(firsts).argmax())
    seconds = np.array([g[1] for g in got if g[0] == t0])
    (ref,) = base.generate({"prompt_token_ids": prompt_ids(smollm2_tokenizer, prompt) + [t0]},
                           SamplingParams(temperature=0.0, max_tokens=1, logprobs=20),
                           use_tqdm=False)
    top = ref.outputs[0].logprobs[0]
    ids = sorted(top, key=lambda t: -top[t].logprob)
    probs = np.exp([top[t].logprob for t in ids])
    keep = probs * len(seconds) >= 5  # bins with an expected count of at least 5
    expected = np.append(probs[keep], 1.0 - probs[keep].sum()) * len(seconds)
    observed = np.append([np.sum(seconds == t) for t in np.array(ids)[keep]],
                         np.sum(~np.isin(seconds, np.array(ids)[keep])))
    stat = float(np.sum((observed - expected) ** 2 / expected))
    assert len(seconds) >= 50 and keep.sum() >= 2, (t0, len(seconds), probs)
    assert stat < chi2_critical(int(keep.sum())), (stat, observed, expected)
    assert got[:40] == token_ids_of(base, prompt, params[:40])


def prompt_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)


def token_ids_of(llm: LLM, prompt: str, params: list) -> list[list[int]]:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_a_draft_that_never_pays_is_paused(smollm2, smollm2_tokenizer, want, tiny_model_dir):
    """The random tiny draft is almost never right: after a window of rejected proposals
    the gate stops proposing (steps overlap again); outputs are unchanged."""
    llm = LLM(smollm2, tokenizer=smollm2_tokenizer,
              speculative_config=draft_config(tiny_model_dir, k=3), **ENGINE_ARGS)
    assert token_ids(llm) == want
    metrics = llm.get_metrics()
    assert metrics["jaxserve:spec_decode_num_pauses"] >= 1
    # Decoding 5 x 15 tokens would verify up to 225 proposals; the pauses skip most.
    assert metrics["jaxserve:spec_decode_num_draft_tokens"] < 150


@pytest.mark.slow
def test_nothing_compiles_after_warm_up(tiny_model_dir, smollm2_tokenizer):
    """Warm-up compiles the draft's steps and its k - 1 step program for every row bucket
    (the tiny model drafting for itself: every proposal holds)."""
    llm = LLM(tiny_model_dir, tokenizer=smollm2_tokenizer, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, num_kv_blocks=48, speculative_config=draft_config(
                  tiny_model_dir, k=3))
    outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert acceptance(llm) > 0.95
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


def test_draft_with_another_vocabulary_is_refused(smollm2, smollm2_tokenizer):
    other = Model(dataclasses.replace(smollm2.cfg, vocab_size=32000), smollm2.params,
                  smollm2.dtype, "other")
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(smollm2, tokenizer=smollm2_tokenizer, speculative_config=draft_config(other),
            **ENGINE_ARGS)


def test_truncate_layers_checks_its_argument(smollm2):
    with pytest.raises(ValueError, match="num_layers"):
        truncate_layers(smollm2, 31)
    assert truncate_layers(smollm2, 3).cfg.num_layers == 3

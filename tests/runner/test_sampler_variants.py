"""`sampler_variants`: the variant a step needs, what promotion sets, that it samples alike."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.runner.sampler_variants import VARIANTS, promote, variant_of
from jaxserve.sample import MAX_LOGPROBS, RowSpec, build_sampling_metadata, sample
from jaxserve.sampling_params import SamplingParams as SP

V, R = 64, 8  # vocab and rows: small, one compile per variant
PENALTY_LEN, BANNED_LEN = 32, 16
FLAGS = ("all_greedy", "needs_filtering", "has_penalties", "has_banned_tokens",
         "max_num_logprobs", "needs_logprobs")
sample_jit = jax.jit(sample)


def md_of(rows, **kw):
    return build_sampling_metadata(rows, R, V, **kw)


def flags(md) -> tuple:
    return tuple(getattr(md, f) for f in FLAGS)


GREEDY = [RowSpec(SP(temperature=0.0)) for _ in range(3)]
RANDOM = [RowSpec(SP(temperature=0.8), seed=11 + i, counter=i) for i in range(5)]
FILTERED = [RowSpec(SP(temperature=1.0, top_k=3, top_p=0.9, min_p=0.05), seed=3 + i)
            for i in range(2)]
PENALISED = [RowSpec(SP(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5),
                     [1, 2, 3], [4, 4, 5], seed=7)]
BANNED = [RowSpec(SP(temperature=0.0, min_tokens=4, stop_token_ids=[9, 10]), (), [1])]
LOGPROBS = [RowSpec(SP(temperature=0.0, logprobs=3))]
TOKEN_LOGPROB = [RowSpec(SP(temperature=0.0, logprobs=0))]  # only the sampled token's
CONTROLS = [RowSpec(SP(temperature=0.0, logit_bias={5: 50.0, 0: -100.0})),
            RowSpec(SP(temperature=0.9, allowed_token_ids=[1, 2, 3]), seed=4)]


@pytest.mark.parametrize("rows,expected", [
    (GREEDY, "greedy"), (RANDOM, "sample"), (GREEDY + RANDOM[:2], "sample"),
    (FILTERED, "sample"), (GREEDY + PENALISED, "full"), (BANNED, "full"), (LOGPROBS, "full"),
    (GREEDY + TOKEN_LOGPROB, "full"), (RANDOM + TOKEN_LOGPROB, "full"),
    (GREEDY + CONTROLS, "full"),
    ([RowSpec(SP(temperature=0.0, top_k=3))], "greedy")])  # greedy drops its filters
def test_variant_of_is_the_cheapest_that_covers_the_step(rows, expected):
    assert variant_of(md_of(rows)) == expected


def test_each_variant_sets_its_flags():
    md = md_of(GREEDY)
    assert flags(md) == (True, False, False, False, 0, False)
    assert promote(md, "greedy", V, PENALTY_LEN, BANNED_LEN) is md
    assert flags(promote(md, "sample", V, PENALTY_LEN, BANNED_LEN)) == (
        False, True, False, False, 0, False)
    full = promote(md, "full", V, PENALTY_LEN, BANNED_LEN)
    assert flags(full) == (False, True, True, True, min(MAX_LOGPROBS, V), True)
    assert flags(promote(md_of(GREEDY), "full", 8, 4, 4))[4] == 8  # logprobs capped at V
    # Absent id arrays become all-padding arrays of the compiled widths.
    for name, width in (("prompt_token_ids", PENALTY_LEN), ("output_token_ids", PENALTY_LEN),
                        ("banned_token_ids", BANNED_LEN)):
        ids = getattr(full, name)
        assert ids.shape == (R, width) and ids.dtype == np.int32 and (ids == V).all()


def test_full_widens_token_id_arrays_keeping_their_ids():
    md = md_of(PENALISED + BANNED)  # widths 16 (the minimum) for every id array
    assert md.prompt_token_ids.shape == (R, 16) and md.banned_token_ids.shape == (R, 16)
    full = promote(md, "full", V, PENALTY_LEN, 64)
    assert full.prompt_token_ids.shape == full.output_token_ids.shape == (R, PENALTY_LEN)
    assert full.banned_token_ids.shape == (R, 64)
    for name in ("prompt_token_ids", "output_token_ids", "banned_token_ids"):
        old, new = getattr(md, name), getattr(full, name)
        np.testing.assert_array_equal(new[:, :old.shape[1]], old, err_msg=name)
        assert (new[:, old.shape[1]:] == V).all(), name
    assert full.prompt_token_ids[0, :3].tolist() == [1, 2, 3]
    assert full.banned_token_ids[1, :2].tolist() == [9, 10]
    assert md.prompt_token_ids.shape == (R, 16)  # the input is not modified


def test_full_trims_padding_columns_but_never_drops_ids():
    # Built wider than compiled: the extra columns are padding only, so they are cut.
    md = md_of(PENALISED, prompt_len_padded=128, output_len_padded=128)
    full = promote(md, "full", V, PENALTY_LEN, BANNED_LEN)
    assert full.prompt_token_ids.shape == (R, PENALTY_LEN)
    np.testing.assert_array_equal(full.prompt_token_ids, md.prompt_token_ids[:, :PENALTY_LEN])
    # A row with more ids than the compiled width keeps them all (a one-off wider compile).
    many = [RowSpec(SP(temperature=0.0, frequency_penalty=0.1), (), list(range(40)))]
    full = promote(md_of(many), "full", V, PENALTY_LEN, BANNED_LEN)
    assert full.output_token_ids.shape == (R, 64)
    assert full.output_token_ids[0, :40].tolist() == list(range(40))
    assert (full.output_token_ids[0, 40:] == V).all()


@pytest.mark.parametrize("rows,too_weak", [
    (RANDOM, ["greedy"]), (FILTERED, ["greedy"]), (PENALISED, ["greedy", "sample"]),
    (BANNED, ["greedy", "sample"]), (LOGPROBS, ["greedy", "sample"])])
def test_refuses_a_variant_that_lacks_a_needed_stage(rows, too_weak):
    md = md_of(rows)
    for variant in too_weak:
        with pytest.raises(ValueError, match="cannot serve"):
            promote(md, variant, V, PENALTY_LEN, BANNED_LEN)


def test_refuses_an_unknown_variant():
    with pytest.raises(ValueError):
        promote(md_of(GREEDY), "fast", V, PENALTY_LEN, BANNED_LEN)


@pytest.mark.parametrize("rows", [GREEDY + RANDOM, GREEDY[:1] + FILTERED + RANDOM[:3],
                                  PENALISED + BANNED + LOGPROBS + RANDOM[:2],
                                  CONTROLS + RANDOM[:3]],
                         ids=["greedy+random", "filtered", "penalties+banned+logprobs",
                              "bias+allowed"])
def test_promotion_samples_the_same_tokens(rows):
    logits = (np.random.default_rng(len(rows)).standard_normal((R, V)) * 2).astype(np.float32)
    # Token 0 (what a wrongly padded id array would ban or penalise) wins in even rows.
    logits[::2, 0] = 12.0
    md = md_of(rows)
    need = VARIANTS.index(variant_of(md))
    ref = jax.tree.map(np.asarray, sample_jit(logits, md))
    # The raw logprobs and ranks "full" adds, as the sampler gives them when asked.
    lp = jax.tree.map(np.asarray, sample_jit(logits, dataclasses.replace(
        md, needs_logprobs=True)))
    np.testing.assert_array_equal(lp.token_ids, ref.token_ids)
    assert not md.all_greedy  # random rows: the draws themselves are compared
    for variant in VARIANTS[need:]:
        promoted = promote(md, variant, V, PENALTY_LEN, BANNED_LEN)
        got = jax.tree.map(np.asarray, sample_jit(logits, promoted))
        np.testing.assert_array_equal(got.token_ids, ref.token_ids, err_msg=variant)
        if variant != "full":
            assert got.logprobs is None and got.token_ranks is None, variant
            continue
        np.testing.assert_array_equal(got.logprobs, lp.logprobs, err_msg=variant)
        np.testing.assert_array_equal(got.token_ranks, lp.token_ranks, err_msg=variant)
    assert (ref.token_ids[:len(rows)] == 0).any()


def test_promotion_of_an_all_greedy_step_keeps_the_argmax():
    logits = (np.random.default_rng(5).standard_normal((R, V)) * 2).astype(np.float32)
    md = md_of(GREEDY)
    for variant in VARIANTS:
        got = sample_jit(logits, promote(md, variant, V, PENALTY_LEN, BANNED_LEN))
        np.testing.assert_array_equal(np.asarray(got.token_ids)[:3], logits[:3].argmax(-1))

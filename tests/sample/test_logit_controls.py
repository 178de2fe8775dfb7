"""logit_bias, allowed_token_ids and bad_words in the on-device sampler, against NumPy."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.sample import RowSpec, build_sampling_metadata, sample
from jaxserve.sampling_params import SamplingParams as SP

V, R = 48, 4
sample_jit = jax.jit(sample)


def logits_of(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((R, V)) * 3).astype(np.float32)


def run(rows, logits):
    md = build_sampling_metadata(rows, R, V)
    return jax.tree.map(np.asarray, sample_jit(logits, md))


def test_logit_bias_is_added_to_the_logits():
    logits = logits_of(1)
    top = logits.argmax(-1)
    rows = [RowSpec(SP(temperature=0.0, logit_bias={7: 100.0}, logprobs=0)),
            RowSpec(SP(temperature=0.0, logit_bias={int(top[1]): -100.0})),
            RowSpec(SP(temperature=0.0, logit_bias={3: 0.5, 9: -0.25})),
            RowSpec(SP(temperature=0.0))]
    out = run(rows, logits)
    ref = logits.copy()
    ref[0, 7] += 100
    ref[1, top[1]] -= 100
    ref[2, 3] += 0.5
    ref[2, 9] -= 0.25
    np.testing.assert_array_equal(out.token_ids, ref.argmax(-1))
    assert out.token_ids[0] == 7 and out.token_ids[1] != top[1]
    # Logprobs (one row asks; every row gets them) stay the model's raw ones (vLLM's
    # default), before any bias.
    raw = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(R), out.token_ids], atol=1e-5)


def test_allowed_token_ids_restrict_only_their_rows():
    logits = logits_of(2)
    allowed = [5, 11, 30]
    rows = [RowSpec(SP(temperature=0.0, allowed_token_ids=allowed)),
            RowSpec(SP(temperature=0.0)),
            RowSpec(SP(temperature=1.0, allowed_token_ids=allowed), seed=3),
            RowSpec(SP(temperature=1.0), seed=3)]
    out = run(rows, logits)
    assert out.token_ids[0] == allowed[int(np.argmax(logits[0, allowed]))]
    assert out.token_ids[1] == logits[1].argmax()
    draws = {int(run([rows[0], rows[1], RowSpec(rows[2].params, seed=s), rows[3]],
                     logits).token_ids[2]) for s in range(40)}
    assert draws <= set(allowed) and len(draws) > 1  # random, but only among the allowed
    # A batch where no row is restricted samples as if the stage were absent.
    plain = [RowSpec(SP(temperature=0.0, logit_bias={1: 0.0}))] + rows[1:2] + [rows[3]]
    np.testing.assert_array_equal(run(plain, logits).token_ids[1:3],
                                  run([rows[1], rows[1], rows[3]], logits).token_ids[1:3])


def test_bias_and_allowed_combine_and_ban_wins():
    logits = logits_of(3)
    rows = [RowSpec(SP(temperature=0.0, allowed_token_ids=[4, 8], logit_bias={8: 100.0},
                       min_tokens=2, stop_token_ids=[8]), (), [1])]
    assert run(rows, logits).token_ids[0] == 4  # 8 is banned below min_tokens


@pytest.mark.parametrize("output, banned", [
    ([1, 2], {9, 6}),  # [2, 6] ends with 2 -> ban 6; the single-token word 9 always
    ([1, 3], {9}),
    ([], {9}),
    ([5, 7, 2], {9, 6, 4}),  # [7, 2, 4] matches its first two tokens too
])
def test_bad_words_ban_the_token_that_would_complete_them(output, banned):
    params = SP(temperature=0.0, bad_words=["x"])
    params.bad_words_token_ids = [[9], [2, 6], [7, 2, 4]]
    md = build_sampling_metadata([RowSpec(params, (), output)], R, V)
    assert md.has_banned_tokens
    got = set(md.banned_token_ids[0].tolist()) - {V}
    assert got == banned
    assert set(params.clone().bad_words_token_ids[1]) == {2, 6}  # kept across copies


@pytest.mark.parametrize("kw, message", [
    (dict(logit_bias={"a": 1}), "keys must be token ids"),
    (dict(logit_bias={1: 100.5}), r"values must be in \[-100, 100\]"),
    (dict(logit_bias={i: 1 for i in range(301)}), "at most 300"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(allowed_token_ids=[]), "must not be empty"),
    (dict(allowed_token_ids=list(range(1025))), "at most 1024"),
    (dict(allowed_token_ids="12"), "list of token ids"),
    (dict(bad_words=[""]), "non-empty strings"),
    (dict(bad_words=["w"] * 65), "at most 64"),
])
def test_bad_values_are_clear_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        SP(**kw)

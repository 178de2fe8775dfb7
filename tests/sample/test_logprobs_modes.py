"""The sampler's `logprobs_mode`s against NumPy (`reference_sampler.py`), and the top-logprobs
widths a `max_logprobs` compiles (`logprobs_widths`, `logprobs_bucket`, the "full" variant)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.runner.sampler_variants import promote
from jaxserve.sample import RowSpec, build_sampling_metadata, logprobs_bucket, logprobs_widths
from jaxserve.sample.sampler import sample
from jaxserve.sampling_params import LOGPROBS_MODES
from jaxserve.sampling_params import SamplingParams as SP
from tests.sample.reference_sampler import log_softmax, processed_logits

V = 64
sample_jit = jax.jit(sample, static_argnums=2)
# Greedy and random rows in one step: penalties, every filter, and a row without logprobs.
ROWS = [
    RowSpec(SP(temperature=0.8, top_k=10, top_p=0.8, min_p=0.05, logprobs=-1), [1, 2], [3],
            seed=1),
    RowSpec(SP(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, logprobs=-1),
            [4, 5], [5, 6, 6], seed=2),
    RowSpec(SP(temperature=1.7, frequency_penalty=0.7, top_p=0.6, logprobs=-1), [7], [8, 8, 9],
            seed=3),
    RowSpec(SP(temperature=1.0, seed=4), [1], [2]),
]


def run(rows, mode: str, logits: np.ndarray):
    md = build_sampling_metadata(rows, len(rows), V)
    return jax.tree.map(np.asarray, sample_jit(logits, md, mode))


def dense(out, row: int) -> np.ndarray:
    """f64[V] a row's whole-vocabulary top logprobs by token id."""
    values = np.full(V, np.nan)
    values[out.topk_token_ids[row]] = out.topk_logprobs[row]
    return values


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((len(ROWS), V)) * 3).astype(np.float32)


@pytest.fixture(scope="module")
def outs(logits) -> dict:
    return {mode: run(ROWS, mode, logits) for mode in LOGPROBS_MODES}


def test_every_mode_samples_the_same_tokens(outs):
    """The mode changes what is returned, never what is drawn."""
    for mode in LOGPROBS_MODES:
        np.testing.assert_array_equal(outs[mode].token_ids, outs["raw_logprobs"].token_ids)
    assert outs["raw_logprobs"].topk_logprobs.shape == (len(ROWS), V)  # -1: every token


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_values_ranks_and_alternatives(outs, logits, mode):
    """Raw modes: the logits as given (or their log-softmax); processed modes: NumPy's
    processed logits (or their log-softmax), the dropped tokens -inf; ranks count the
    tokens valued at least the sampled one's; alternatives come in descending order."""
    out = outs[mode]
    for row, spec in enumerate(ROWS[:3]):
        want = logits[row].astype(np.float64)
        if mode.startswith("processed"):
            want = processed_logits(logits[row], spec.prompt_token_ids, spec.output_token_ids,
                                    spec.params)
        if mode.endswith("logprobs"):
            want = log_softmax(want)
        got = dense(out, row)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        kept = np.isfinite(want)
        np.testing.assert_allclose(got[kept], want[kept], rtol=1e-5, atol=1e-4)
        token = out.token_ids[row]
        assert out.logprobs[row] == pytest.approx(want[token], rel=1e-5, abs=1e-4)
        assert out.token_ranks[row] == int((want >= want[token] - 1e-5).sum())
        assert np.all(np.diff(out.topk_logprobs[row][np.isfinite(out.topk_logprobs[row])]) <= 0)
    if mode.startswith("processed"):
        assert np.isneginf(dense(out, 0)).sum() >= V - 10  # top-k 10 dropped the rest


def test_all_greedy_processed_is_after_the_penalties(logits):
    """A step of greedy rows only (no draw compiled): processed = the penalised logits
    (no temperature or filter applies to greedy rows, as vLLM's early return)."""
    rows = [ROWS[1], RowSpec(SP(temperature=0.0, logprobs=3), [1], [])]
    out = run(rows, "processed_logprobs", logits[1:3])
    want = log_softmax(processed_logits(logits[1], [4, 5], [5, 6, 6], ROWS[1].params))
    np.testing.assert_allclose(dense(out, 0), want, rtol=1e-5, atol=1e-4)
    assert out.logprobs[1] == pytest.approx(log_softmax(logits[2].astype(float)).max(),
                                            abs=1e-5)


def test_unknown_mode_is_refused(logits):
    md = build_sampling_metadata(ROWS[3:], 1, V)
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        sample(logits[3:], md, "processed")


@pytest.mark.parametrize("max_logprobs, vocab, widths", [
    (20, 49152, (20,)), (5, 49152, (20,)), (0, 49152, (20,)), (21, 49152, (20, 21)),
    (-1, 49152, (20, 49152)), (10**6, 49152, (20, 49152)), (-1, 12, (12,)), (30, 25, (20, 25)),
])
def test_logprobs_widths(max_logprobs, vocab, widths):
    """One width (today's 20) up to max_logprobs 20; above it one wide width more."""
    assert logprobs_widths(max_logprobs, vocab) == widths


def test_buckets_and_the_full_variant_keep_the_wide_width():
    assert [logprobs_bucket(n) for n in (0, 1, 20, 21)] == [0, 20, 20, 21]
    assert [logprobs_bucket(n, 64) for n in (0, 5, 20, 21, 64)] == [0, 20, 20, 64, 64]
    wide = build_sampling_metadata([RowSpec(SP(logprobs=25), seed=1)], 2, V, wide_logprobs=40)
    narrow = build_sampling_metadata([RowSpec(SP(logprobs=2), seed=1)], 2, V, wide_logprobs=40)
    whole = build_sampling_metadata([RowSpec(SP(logprobs=-1), seed=1)], 2, V)
    assert (wide.max_num_logprobs, narrow.max_num_logprobs, whole.max_num_logprobs) == (40, 20, V)
    plain = build_sampling_metadata([RowSpec(SP(temperature=0))], 2, V)
    assert [promote(md, "full", V, 16, 64).max_num_logprobs
            for md in (wide, narrow, plain)] == [40, 20, 20]


def test_engine_arguments_from_the_command_line():
    """`--max-logprobs` / `--logprobs-mode` reach the engine config (serve and generate share
    the engine flags); a mode that is not vLLM's is refused by argparse and by the config."""
    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.cli import build_parser, engine_kwargs

    for command in (["serve"], ["generate", "hi"]):
        args = build_parser().parse_args([*command, "--max-logprobs", "-1",
                                          "--logprobs-mode", "processed_logits"])
        model = EngineConfig.from_kwargs(**engine_kwargs(args)).model
        assert (model.max_logprobs, model.logprobs_mode) == (-1, "processed_logits")
    assert EngineConfig().model.max_logprobs == 20
    assert EngineConfig().model.logprobs_mode == "raw_logprobs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--logprobs-mode", "processed"])
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        EngineConfig.from_kwargs(max_logprobs=-3)

"""Sampler: greedy, seeded draws, filtered distributions, penalties, logprobs, no recompiles."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.sample import (
    MAX_LOGPROBS,
    RowSpec,
    SamplingMetadata,
    apply_filters,
    apply_penalties,
    build_sampling_metadata,
    compute_prompt_logprobs,
    padded_len,
    sample,
)
from jaxserve.sample.filters import NUM_CANDIDATES, _candidate_threshold
from jaxserve.sampling_params import SamplingParams as SP
from jaxserve.sampling_params import device_seed

# NOTE: one jitted sampler and mostly R=8, V=64 keep the number of compiles (about 0.5-1 s
# each on a small CPU) low; tests that need other shapes say why.
sample_jit = jax.jit(sample)
filters_jit = jax.jit(apply_filters)
penalties_jit = jax.jit(apply_penalties)


def logits_of(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((num_rows, vocab_size)) * scale
            ).astype(np.float32)


def run(logits: np.ndarray, rows, num_rows_padded: int | None = None, **kw):
    md = build_sampling_metadata(rows, num_rows_padded or logits.shape[0], logits.shape[1],
                                 **kw)
    return jax.tree.map(np.asarray, sample_jit(logits, md))


def test_temperature_zero_is_argmax_in_a_mixed_batch():
    logits = logits_of(8, 64)
    rows = [RowSpec(SP(temperature=0.0 if i % 2 == 0 else 1.0), seed=i) for i in range(8)]
    out = run(logits, rows)
    np.testing.assert_array_equal(out.token_ids[::2], logits[::2].argmax(-1))
    all_greedy = run(logits, [RowSpec(SP(temperature=0.0)) for _ in range(8)])
    np.testing.assert_array_equal(all_greedy.token_ids, logits.argmax(-1))


def test_top_k_one_equals_greedy():
    logits = logits_of(8, 64, seed=1)
    rows = [RowSpec(SP(temperature=1.5, top_k=1), seed=i, counter=3 * i) for i in range(8)]
    np.testing.assert_array_equal(run(logits, rows).token_ids, logits.argmax(-1))


def test_same_seed_same_tokens_whatever_the_batch():
    vocab_size, num_rows_padded = 64, 48
    target = SP(temperature=1.0, top_p=0.95, seed=1234)
    others = [RowSpec(SP(temperature=0.7, top_k=5, repetition_penalty=1.3), [1, 2], [3],
                      seed=99 + i) for i in range(8)]
    # One request at counters 0..15 in batch A (rows 0..15, then one other request) ...
    a = run(np.zeros((num_rows_padded, vocab_size), np.float32),
            [RowSpec(target, counter=c) for c in range(16)] + others[:1])
    # ... and in batch B at other row indices, among other requests, with padding.
    rows_b, where = [], []
    for c in reversed(range(16)):
        rows_b.append(others[c % 8])
        where.append(len(rows_b))
        rows_b.append(RowSpec(target, counter=c))
    logits_b = logits_of(num_rows_padded, vocab_size, seed=3)
    logits_b[where] = 0.0
    b = run(logits_b, rows_b)
    np.testing.assert_array_equal(b.token_ids[where][::-1], a.token_ids[:16])
    # Different counters give different draws.
    assert len(set(a.token_ids[:16].tolist())) >= 10


def test_seed_from_row_overrides_params():
    logits = np.zeros((8, 64), np.float32)
    out = run(logits, [RowSpec(SP(seed=1), counter=i % 4, seed=None if i < 4 else 2)
                       for i in range(8)])
    assert out.token_ids[:4].tolist() != out.token_ids[4:].tolist()
    with pytest.raises(ValueError, match="seed"):
        build_sampling_metadata([RowSpec(SP())], 1, 10)


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> np.ndarray:
    """vLLM's filtered distribution, written the slow obvious way."""
    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    x = logits.astype(np.float64) / temperature
    probs = softmax(x)
    x = np.where(probs < min_p * probs.max(), -np.inf, x)
    order = np.argsort(-x, kind="stable")
    if top_k > 0:
        x[order[top_k:]] = -np.inf
    probs = softmax(x)
    kept = 0.0
    for i in order:
        if kept >= top_p:
            x[i] = -np.inf
        kept += probs[i]
    return softmax(x)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0),
    (0.6, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.7, 0.0),
    (1.0, 0, 1.0, 0.15),
    (1.7, 5, 0.85, 0.05),
])
def test_frequencies_match_the_filtered_distribution(temperature, top_k, top_p, min_p):
    # 4000 draws of one V=8 distribution in one call: one seed, counters 0..3999.
    num_draws, vocab_size = 4000, 8
    base = np.array([[2.0, 1.5, 1.2, 1.0, 0.5, 0.0, -0.5, -1.0]], np.float32)
    params = SP(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=7)
    out = run(np.repeat(base, num_draws, 0),
              [RowSpec(params, counter=c) for c in range(num_draws)])
    counts = np.bincount(out.token_ids, minlength=vocab_size)
    expected = reference_probs(base[0], temperature, top_k, top_p, min_p)
    assert counts[expected == 0].sum() == 0
    nz = expected > 0
    chi2 = (((counts[nz] - num_draws * expected[nz]) ** 2) / (num_draws * expected[nz])).sum()
    assert chi2 < 35.0, (chi2, counts / num_draws, expected)  # df <= 7: p < 2e-5
    assert 0.5 * np.abs(counts / num_draws - expected).sum() < 0.04


def test_top_p_keeps_the_smallest_set_reaching_p_and_filters_combine():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    order = [1, 3, 0, 2]  # column of the largest, second, ... probability
    logits = np.log(probs)[None, [2, 0, 3, 1]].repeat(8, 0)  # shuffled columns
    #                    top_p alone ............  combined with top_k / min_p ...
    top_p = np.array([0.45, 0.55, 0.81, 0.96, 1.0, 0.96, 0.81, 0.96], np.float32)
    top_k = np.array([0, 0, 0, 0, 0, 2, 1, 0], np.int32)
    min_p = np.array([0, 0, 0, 0, 0, 0, 0, 0.2], np.float32)
    expected_sizes = [1, 2, 3, 4, 4, 2, 1, 3]  # 0.15 >= 0.2 * 0.5 but 0.05 is not
    out = np.asarray(filters_jit(logits, top_k, top_p, min_p))
    for row, kept, size in zip(out, np.isfinite(out), expected_sizes, strict=True):
        assert set(np.flatnonzero(kept)) == set(order[:size])
        np.testing.assert_array_equal(row[kept], logits[0][kept])  # kept logits unchanged


def assert_filters_match_reference(logits, top_k, top_p, min_p):
    """`apply_filters` keeps exactly the tokens `reference_probs` keeps, unchanged."""
    out = np.asarray(filters_jit(logits, top_k, top_p, min_p))
    for i in range(logits.shape[0]):
        want = reference_probs(logits[i], 1.0, int(top_k[i]), float(top_p[i]),
                               float(min_p[i])) > 0
        np.testing.assert_array_equal(np.isfinite(out[i]), want, err_msg=f"row {i}")
        np.testing.assert_array_equal(out[i][want], logits[i][want])


def test_filters_match_numpy_on_random_rows():
    rng = np.random.default_rng(8)
    for _ in range(10):
        logits = logits_of(8, 64, seed=int(rng.integers(1 << 30)), scale=float(rng.uniform(1, 6)))
        logits[0, :5] = -np.inf  # already banned tokens
        top_k = rng.choice([0, 1, 2, 5, 20, 63, 64], 8).astype(np.int32)
        top_p = rng.choice([1.0, 0.9, 0.5, 0.1], 8).astype(np.float32)
        min_p = rng.choice([0.0, 0.0, 0.01, 0.3], 8).astype(np.float32)
        assert_filters_match_reference(logits, top_k, top_p, min_p)


PEAKED, FLAT = 8.0, 0.3  # logit scales: top-p sets within the candidates, or far wider


@pytest.mark.parametrize("scales, top_k, top_p, unsettled", [
    # Every k within the candidates: thresholds read off the candidates.
    ([PEAKED] * 8, [0, 1, 5, NUM_CANDIDATES, 0, 2, 0, 7],
     [0.9, 1.0, 0.5, 1.0, 0.1, 0.95, 0.7, 0.8], 0),
    # Two rows the candidates cannot settle (at most half of 8): bisected apart.
    ([PEAKED] * 6 + [FLAT] * 2, [0, 1, 5, NUM_CANDIDATES, 0, 2, 0, 0],
     [0.9, 1.0, 0.5, 1.0, 0.1, 0.95, 0.99, 0.9], 2),
    # Five k above the candidates: the whole step bisects.
    ([PEAKED] * 8, [0, NUM_CANDIDATES + 2, 5, NUM_CANDIDATES + 1, 200, 300, 0, 400],
     [0.9, 1.0, 0.5, 1.0, 0.1, 0.95, 0.7, 0.8], 5),
    # Flat rows: top-p sets wider than the candidates, the whole step bisects.
    ([FLAT] * 8, [0, 1, 0, NUM_CANDIDATES, 0, 2, 0, 0],
     [0.9, 1.0, 0.6, 1.0, 0.7, 0.95, 0.99, 0.5], 5),
], ids=["candidates", "two-bisected", "k-above", "flat"])
def test_filters_over_a_large_vocab_match_numpy(scales, top_k, top_p, unsettled):
    # NOTE: V above NUM_CANDIDATES (the other filter tests' V=64 always bisects). Not
    # top_p = 1 without top-k on peaked rows: the float64 reference reaches 1.0 before
    # their tails and drops them, where the filter keeps everything by rule.
    vocab = 4 * NUM_CANDIDATES + 3
    logits = logits_of(8, vocab, seed=9, scale=1.0) * np.array(scales, np.float32)[:, None]
    logits[0, :5] = -np.inf
    top_k, top_p = np.array(top_k, np.int32), np.array(top_p, np.float32)
    min_p = np.array([0, 0, 0, 0, 0.05, 0, 0, 0], np.float32)
    with np.errstate(divide="ignore"):  # log(0) = -inf: min-p off
        floor = logits.max(-1, keepdims=True) + np.log(min_p)[:, None]
    after_min_p = np.where(logits < floor, -np.inf, logits)
    k = np.where(top_k <= 0, vocab, top_k)
    _, ok = jax.jit(_candidate_threshold)(after_min_p, logits.max(-1, keepdims=True), k, top_p)
    assert int(np.sum(~np.asarray(ok))) == unsettled
    assert_filters_match_reference(logits, top_k, top_p, min_p)


def test_filters_keep_ties_at_the_threshold():
    logits = np.full((8, 64), -5.0, np.float32)
    logits[:, :4] = [3.0, 2.0, 2.0, 1.0]
    logits[:, 10] = -0.0
    logits[:, 11] = 0.0
    top_k = np.array([2, 3, 0, 0, 0, 0, 0, 0], np.int32)
    top_p = np.array([1.0, 1.0, 0.6, 1.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    kept = np.isfinite(np.asarray(filters_jit(logits, top_k, top_p, np.zeros(8, np.float32))))
    assert np.flatnonzero(kept[0]).tolist() == [0, 1, 2]
    assert np.flatnonzero(kept[1]).tolist() == [0, 1, 2]
    assert np.flatnonzero(kept[2]).tolist() == [0, 1, 2]  # one 2.0 reaches 0.6; its tie stays
    assert kept[3:].all()
    logits[:, :4] = -3.0  # now the two zeros of opposite sign are the top tokens
    kept = np.isfinite(np.asarray(filters_jit(logits, np.ones(8, np.int32),
                                              np.ones(8, np.float32), np.zeros(8, np.float32))))
    assert np.flatnonzero(kept[0]).tolist() == [10, 11]


def penalty_rows(num_rows: int, rng: np.random.Generator, vocab_size: int):
    rows = []
    for i in range(num_rows):
        params = SP(temperature=0.0, repetition_penalty=float(rng.uniform(0.5, 2.0)),
                    presence_penalty=float(rng.uniform(-2, 2)),
                    frequency_penalty=float(rng.uniform(-2, 2)))
        prompt = rng.integers(0, vocab_size, rng.integers(1, 20)).tolist()
        output = rng.integers(0, vocab_size, rng.integers(0, 30)).tolist()
        rows.append(RowSpec(params, prompt, output, seed=i))
    return rows


def test_penalties_match_transformers_and_openai():
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(5)
    vocab_size, num_rows = 64, 6
    logits = logits_of(num_rows, vocab_size, seed=5)
    rows = penalty_rows(num_rows, rng, vocab_size)
    md = build_sampling_metadata(rows, num_rows + 2, vocab_size)
    padded_logits = np.concatenate([logits, np.zeros((2, vocab_size), np.float32)])
    got = np.asarray(penalties_jit(padded_logits, md))
    for i, row in enumerate(rows):
        p = row.params
        ids = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            ids, torch.tensor(logits[i:i + 1])).numpy()[0]
        counts = np.bincount(np.asarray(row.output_token_ids, int), minlength=vocab_size)
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[num_rows:], 0.0)  # padded rows untouched
    # Greedy rows take exactly the argmax of the penalised logits.
    out = run(padded_logits, rows)
    np.testing.assert_array_equal(out.token_ids[:num_rows], got[:num_rows].argmax(-1))


def test_min_tokens_bans_stop_and_eos():
    logits = np.zeros((8, 64), np.float32)
    logits[:, 4], logits[:, 6], logits[:, 1] = 5.0, 4.0, 3.0
    params = SP(temperature=0.0, min_tokens=2, stop_token_ids=[6])
    rows = [RowSpec(params, counter=0), RowSpec(params, counter=2),
            RowSpec(params.clone(ignore_eos=True), counter=1)]
    out = run(logits, rows, eos_token_id=4)
    assert out.token_ids[:3].tolist() == [1, 4, 4]


def test_logprobs_match_torch():
    torch = pytest.importorskip("torch")
    logits = logits_of(8, 64, seed=9, scale=6.0)
    rows = [RowSpec(SP(temperature=0.8 + 0.1 * i, top_k=50, logprobs=i,
                       repetition_penalty=1.5), [1, 2], [3], seed=i) for i in range(8)]
    out = run(logits, rows)
    ref = torch.log_softmax(torch.tensor(logits), -1)
    want = ref.gather(1, torch.tensor(out.token_ids[:, None], dtype=torch.long))[:, 0]
    np.testing.assert_allclose(out.logprobs, want.numpy(), atol=1e-5)
    top = torch.topk(ref, MAX_LOGPROBS, -1)
    np.testing.assert_allclose(out.topk_logprobs, top.values.numpy(), atol=1e-5)
    np.testing.assert_array_equal(out.topk_token_ids, top.indices.numpy())
    ranks = (ref >= want[:, None]).sum(-1).numpy()
    np.testing.assert_array_equal(out.token_ranks, ranks)
    no_logprobs = run(logits, [RowSpec(r.params.clone(logprobs=None), *r[1:]) for r in rows])
    assert no_logprobs.topk_token_ids is None and no_logprobs.topk_logprobs is None


def test_prompt_logprobs_match_torch():
    torch = pytest.importorskip("torch")
    logits = logits_of(12, 64, seed=11, scale=4.0)
    next_ids = np.random.default_rng(0).integers(0, 64, 12).astype(np.int32)
    got = jax.tree.map(np.asarray, compute_prompt_logprobs(logits, next_ids, 5))
    ref = torch.log_softmax(torch.tensor(logits), -1)
    want = ref[torch.arange(12), torch.tensor(next_ids, dtype=torch.long)].numpy()
    np.testing.assert_allclose(got.token_logprobs, want, atol=1e-5)
    np.testing.assert_array_equal(got.token_ranks, (ref.numpy() >= want[:, None]).sum(-1))
    top = torch.topk(ref, 5, -1)
    np.testing.assert_allclose(got.topk_logprobs, top.values.numpy(), atol=1e-5)
    np.testing.assert_array_equal(got.topk_token_ids, top.indices.numpy())


def test_padded_rows_are_harmless():
    rng = np.random.default_rng(2)
    logits = logits_of(3, 64, seed=2)
    rows = [RowSpec(SP(temperature=0.9, top_p=0.8, min_p=0.02, logprobs=3)),
            RowSpec(SP(temperature=0.0, frequency_penalty=0.5), [1], [2, 2]),
            RowSpec(SP(temperature=1.2, top_k=4, repetition_penalty=1.1), [5], [6])]
    rows = [RowSpec(r.params, r.prompt_token_ids, r.output_token_ids,
                    seed=int(rng.integers(1 << 31)), counter=i) for i, r in enumerate(rows)]
    md = build_sampling_metadata(rows, 8, 64)
    assert md.temperature[3:].tolist() == [0.0] * 5 and (md.prompt_token_ids[3:] == 64).all()
    outs = []
    for pad_value in (np.nan, np.inf, -1e30, 0.0):
        padded_logits = np.full((8, 64), pad_value, np.float32)
        padded_logits[:3] = logits
        outs.append(run(padded_logits, rows))
        assert ((outs[-1].token_ids >= 0) & (outs[-1].token_ids < 64)).all()
    for out in outs[1:]:  # real rows never see what sits in the padded rows
        np.testing.assert_array_equal(out.token_ids[:3], outs[0].token_ids[:3])
        np.testing.assert_array_equal(out.logprobs[:3], outs[0].logprobs[:3])
        np.testing.assert_array_equal(out.topk_token_ids[:3], outs[0].topk_token_ids[:3])


def test_new_sampling_values_do_not_recompile():
    if not hasattr(sample_jit, "_cache_size"):
        pytest.skip("this jax has no PjitFunction._cache_size")
    vocab_size = 64
    logits = logits_of(8, vocab_size, seed=4)
    rng = np.random.default_rng(0)
    sizes = []
    for step in range(6):
        rows = [RowSpec(SP(temperature=float(rng.uniform(0.1, 2.0)), seed=int(rng.integers(99)),
                           top_k=int(rng.integers(0, 10)), top_p=float(rng.uniform(0.1, 0.99)),
                           min_p=float(rng.uniform(0, 0.2)), logprobs=int(rng.integers(1, 5)),
                           presence_penalty=float(rng.uniform(-1, 1)),
                           repetition_penalty=float(rng.uniform(0.8, 1.5))),
                        rng.integers(0, vocab_size, rng.integers(1, 16)).tolist(),
                        rng.integers(0, vocab_size, rng.integers(0, 16)).tolist(),
                        counter=step)
                for _ in range(6)]
        rows.append(RowSpec(SP(temperature=0.0)))
        md = build_sampling_metadata(rows, 8, vocab_size)
        jax.block_until_ready(sample_jit(logits, md))
        # NOTE: the cache is shared by every jax.jit of `sample`, so count its growth.
        sizes.append(sample_jit._cache_size())
    assert sizes[1:] == sizes[:1] * 5


def test_builder_shapes_and_errors():
    assert [padded_len(n) for n in (0, 1, 16, 17, 100)] == [16, 16, 16, 32, 128]
    md = build_sampling_metadata([RowSpec(SP(temperature=0.0))], 4, 10)
    assert isinstance(md, SamplingMetadata) and md.num_rows == 4
    assert md.all_greedy and not md.needs_filtering and not md.has_penalties
    assert md.prompt_token_ids is None and md.max_num_logprobs == 0
    md = build_sampling_metadata([(SP(top_k=100, seed=1), [1] * 40, [2] * 3)], 2, 50)
    assert md.top_k.tolist() == [0, 0] and not md.needs_filtering  # k >= V is off
    md = build_sampling_metadata([(SP(repetition_penalty=2.0, seed=1), [1] * 40, [2] * 3)],
                                 2, 50, output_len_padded=8)
    assert md.prompt_token_ids.shape == (2, 64) and md.output_token_ids.shape == (2, 8)
    assert md.seeds.dtype == np.uint32 and md.counters.tolist() == [3, 0]
    # a seed past 32 bits is folded from all its bits (`device_seed`), not truncated
    wide = build_sampling_metadata([(SP(seed=2**33 - 1), [1])], 1, 8).seeds.tolist()
    assert wide == [device_seed(2**33 - 1)] and wide != [2**32 - 1]
    assert build_sampling_metadata([(SP(seed=5), [1])], 1, 8).seeds.tolist() == [5]
    with pytest.raises(ValueError, match="num_rows_padded"):
        build_sampling_metadata([RowSpec(SP(seed=1))] * 3, 2, 10)
    with pytest.raises(ValueError, match="prompt_len_padded"):
        build_sampling_metadata([(SP(repetition_penalty=2.0, seed=1), [1] * 40)], 1, 50,
                                prompt_len_padded=32)

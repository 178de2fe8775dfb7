"""`batch_invariant=True`: every request's raw logprobs bit-for-bit equal to its own run
alone (the oracle), in a batch of 31 random others, at chunk sizes 16/64/256, with prefix
hits, after preemption by recompute and by swap, under async scheduling, on the `xla` and
`cpu` backends; the default mode is not (so these tests can fail); `jaxserve verify`.

Records are (greedy token, top-5 raw logprobs) per output position
(`jaxserve.entrypoints.verify.records`), compared with `==` on Python floats: bitwise.
The tiny model (`tiny_model_dir`) at `TINY_ENGINE` sizes; the expensive combinations (the
cpu backend's beyond the crowd, chunk 256's own buckets, swap) are in the slow tier.
"""

from __future__ import annotations

import pytest

from jaxserve import LLM
from jaxserve.entrypoints import verify as v
from pallas_kernels import cpu_ffi
from tests.conftest import TINY_ENGINE

MAX_TOKENS = 8
PARAMS = v.greedy_params(MAX_TOKENS)
SMALL_POOL = 24  # pages: 16 running requests of up to ~120 tokens preempt each other
needs_cpu = pytest.mark.skipif(not cpu_ffi.available(),
                               reason="the cpu backend's kernel does not build here")
BACKENDS = ["xla", pytest.param("cpu", marks=needs_cpu)]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    """Eight prompts: two chat-templated (one German), code (Python, C), a long story
    (~110 tokens: chunked at 16 and 64), Chinese, Russian, numbers."""
    return v.prompt_ids(smollm2_tokenizer, v.DEFAULT_PROMPTS)


@pytest.fixture(scope="module")
def others() -> list[list[int]]:
    """The crowd: 31 prompts of random ids, 1-100 tokens."""
    return v.random_prompts(31, 49152, seed=1)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """Engines by (backend, overrides), built once per module."""
    made = {}

    def get(backend: str, **overrides) -> LLM:
        key = (backend, tuple(sorted(overrides.items())))
        if key not in made:
            args = {**TINY_ENGINE, "warmup": False, "enable_prefix_caching": False,
                    "batch_invariant": True, "attention_backend": backend, **overrides}
            made[key] = LLM(tiny_model_dir, **args)
        return made[key]

    return get


@pytest.fixture(scope="module")
def alone(engines, prompts):
    """The oracle: each prompt in a `generate` call of its own, per backend."""
    cache = {}

    def get(backend: str):
        if backend not in cache:
            cache[backend] = v.run_alone(engines(backend), prompts, PARAMS)
        return cache[backend]

    return get


def assert_bitwise(want, got, label: str) -> None:
    bad = [d for d in v.compare(want, got, 1e-3) if d.kind != "identical"]
    assert not bad, f"{label}: " + "; ".join(
        f"prompt {d.index} {d.kind} at token {d.position} (max |d| {d.max_abs:.3g})"
        for d in bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_crowded_batch(engines, alone, prompts, others, backend):
    """In one batch with 31 random others (shuffled; chunk 64, async scheduling)."""
    llm = engines(backend)
    assert_bitwise(alone(backend), v.run_crowded(llm, prompts, others, PARAMS, seed=2),
                   f"{backend} crowded")


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=[needs_cpu,
                                                                       pytest.mark.slow])])
@pytest.mark.parametrize("chunk", [16, pytest.param(256, marks=pytest.mark.slow)])
def test_chunk_sizes(engines, alone, prompts, others, backend, chunk):
    """Prefill chunks of 16 (`long_prefill_token_threshold`, the same programs) and 256
    (`max_num_batched_tokens`: every prompt whole, buckets of its own), crowded."""
    over = ({"long_prefill_token_threshold": 16} if chunk == 16
            else {"max_num_batched_tokens": 256})
    llm = engines(backend, **over)
    assert_bitwise(alone(backend), v.run_crowded(llm, prompts, others, PARAMS, seed=3),
                   f"{backend} chunk {chunk}")


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=[needs_cpu,
                                                                       pytest.mark.slow])])
def test_prefix_cache_hits(engines, alone, prompts, others, backend):
    """The crowd twice with prefix caching: the second run starts from cached pages."""
    llm = engines(backend, enable_prefix_caching=True)
    first = v.run_crowded(llm, prompts, others, PARAMS, seed=4)
    hits = llm.get_metrics()["jaxserve:prefix_cache_hits"]
    second = v.run_crowded(llm, prompts, others, PARAMS, seed=5)
    assert llm.get_metrics()["jaxserve:prefix_cache_hits"] > hits
    assert_bitwise(alone(backend), first, f"{backend} prefix caching, first run")
    assert_bitwise(alone(backend), second, f"{backend} prefix caching, with hits")


@pytest.mark.parametrize("backend", ["xla", pytest.param("cpu", marks=[needs_cpu,
                                                                       pytest.mark.slow])])
# NOTE: both modes in the slow tier (15 s of an engine with a small pool); the default tier's
# chunk-size and prefix-hit cases recompute prompts at other splits too.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(engines, alone, prompts, others, backend, mode):
    """A pool of 24 pages: requests are preempted (recomputed from token 0, or swapped out
    and back) and still give their alone run's bits."""
    llm = engines(backend, num_kv_blocks=SMALL_POOL, preemption_mode=mode)
    got = v.run_crowded(llm, prompts, others, PARAMS, seed=6)
    assert llm.get_metrics()["jaxserve:num_preemptions"] > 0
    assert_bitwise(alone(backend), got, f"{backend} preemption by {mode}")


@pytest.mark.slow
def test_without_async_scheduling(engines, alone, prompts, others):
    llm = engines("xla", async_scheduling=False)
    assert_bitwise(alone("xla"), v.run_crowded(llm, prompts, others, PARAMS, seed=7),
                   "xla, async scheduling off")


@pytest.mark.slow  # what the default mode lacks; the mode's own tests stay in the default tier
def test_default_mode_is_not_invariant(tiny_model_dir, alone, prompts, others):
    """Without the mode, some raw logprob of some prompt differs between its run alone and
    its run in the crowd (XLA's dot blocking follows the number of rows): what the tests
    above would catch. And the mode computes the same function: its tokens are the default
    mode's and its logprobs within float32 noise of them (the default mode's own oracle is
    transformers, `tests/e2e/test_engine_sampling.py`)."""
    llm = LLM(tiny_model_dir, **{**TINY_ENGINE, "warmup": False,
                                 "enable_prefix_caching": False})
    want = v.run_alone(llm, prompts, PARAMS)
    got = v.run_crowded(llm, prompts, others, PARAMS, seed=2)
    kinds = [d.kind for d in v.compare(want, got, 1e-3)]
    assert any(k != "identical" for k in kinds), kinds
    for default, invariant in zip(want, alone("xla"), strict=True):
        assert [t for t, _ in default] == [t for t, _ in invariant]
        for (_, a), (_, b) in zip(default, invariant, strict=True):
            assert [i for i, _ in a] == [i for i, _ in b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4


# NOTE: slow: warm-up compiles every bucket and sampler variant of a new engine.
@pytest.mark.slow
def test_no_compilation_after_warmup(tiny_model_dir, alone, prompts, others):
    """Static shapes: after warm-up, the crowd (prefill chunks, decodes, several buckets)
    compiles nothing, and still gives the alone runs' bits."""
    llm = LLM(tiny_model_dir, **{**TINY_ENGINE, "warmup": True, "enable_prefix_caching": False,
                                 "batch_invariant": True, "attention_backend": "xla"})
    got = v.run_crowded(llm, prompts, others, PARAMS, seed=8)
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0
    assert_bitwise(alone("xla"), got, "xla after warm-up")

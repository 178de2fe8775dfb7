"""Warm-up: programs compiled ahead on threads are the ones the warm-up pass runs, the
thread count's setting, and progress for `/health`."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.plans import CopyPlan, KVPlans, SwapPlan
from jaxserve.runner import compile_counter, warmup
from jaxserve.runner.kv_ops import PLAN_PAIRS
from tests.conftest import TINY_ENGINE

# NOTE: the shared tiny-engine sizes: the programs are those of the other tiny engines,
# compiled once per test run (the first warm-up to run compiles them, the others load
# them from the compilation cache); a swap space adds the swap plans' programs.
ARGS = {**TINY_ENGINE, "swap_space": 0.01}
BUCKETS = [4, 8, 16, 32, 64]


# NOTE: 2 threads first: where nothing is cached yet, it compiles on both cores.
@pytest.mark.parametrize("threads", [2, 1])
def test_warmup_pass_finds_every_program_compiled_ahead(tiny_model_dir, monkeypatch, threads):
    """With threads > 1 every program is lowered and compiled before the pass that runs
    them, which then lowers nothing (a miss there would compile twice). With 1 thread the
    pass compiles them itself."""
    monkeypatch.setenv("JAXSERVE_COMPILE_THREADS", str(threads))
    counts, progress = {}, []
    run_bucket = warmup.run_bucket

    def spy(runner, num_tokens, make_dummy_sampling):
        counts.setdefault("pass", compile_counter.num_compilations())
        progress.append(runner.warmup_progress)
        run_bucket(runner, num_tokens, make_dummy_sampling)
        counts["after"] = compile_counter.num_compilations()

    monkeypatch.setattr(warmup, "run_bucket", spy)
    llm = LLM(tiny_model_dir, **ARGS)
    runner = llm.engine.runner
    total = len(BUCKETS)
    assert runner.buckets == BUCKETS and runner.warmup_progress == (total, total)
    if threads > 1:
        assert counts["after"] == counts["pass"], "the warm-up pass compiled a program again"
        assert progress == [(total, total)] * total  # every bucket compiled before the pass
    else:
        assert counts["after"] > counts["pass"]
        assert progress == [(i, total) for i in range(total)]
    # Serving afterwards compiles nothing; nor do plans of several pieces.
    out = llm.generate(["a b c"] * 3, SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    metrics = llm.get_metrics()
    assert metrics["jaxserve:num_compilations"] == 0
    assert 0 < metrics["jaxserve:padding_waste_ratio"] < 1  # 3-token rows padded to buckets
    n = 2 * PLAN_PAIRS + 1
    before = compile_counter.num_compilations()
    runner.execute_plans(KVPlans(swap_out=SwapPlan([(0, s) for s in range(n)], to_host=True),
                                 swap_in=SwapPlan([(s, 0) for s in range(n)], to_host=False),
                                 copy=CopyPlan([(0, 0)] * n)))
    assert compile_counter.num_compilations() == before
    # A compilation elsewhere in the process (another engine, user code) is not this
    # engine's.
    jax.jit(lambda x: x * 3 + 1)(np.arange(5.0))
    assert compile_counter.num_compilations() > before
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_compile_threads_setting_must_be_a_positive_integer(monkeypatch, value):
    monkeypatch.setenv("JAXSERVE_COMPILE_THREADS", value)
    with pytest.raises(ValueError, match="JAXSERVE_COMPILE_THREADS"):
        warmup.compile_threads()


def test_compile_threads_default_and_override(monkeypatch):
    monkeypatch.delenv("JAXSERVE_COMPILE_THREADS", raising=False)
    assert 1 <= warmup.compile_threads() <= warmup.MAX_COMPILE_THREADS
    monkeypatch.setenv("JAXSERVE_COMPILE_THREADS", "3")
    assert warmup.compile_threads() == 3


def test_dropping_staging_caches_keeps_compiled_programs():
    # What `LLMEngine.warmup` does last: the jaxprs and MLIR modules go, each jitted
    # function's own dispatch cache stays, so a warmed program runs without tracing again.
    import jax.numpy as jnp

    from jaxserve.compilation_cache import drop_staging_caches

    compile_counter.install()
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    x, y = jnp.arange(4.0), jnp.arange(5.0)
    f(x)
    start = compile_counter.num_compilations()
    assert drop_staging_caches()  # the JAX internal it calls exists in this version
    np.testing.assert_array_equal(f(x), np.arange(4.0) * 2 + 1)
    assert compile_counter.num_compilations() == start
    f(y)  # a shape never compiled traces, as it always would
    assert compile_counter.num_compilations() == start + 1


def test_a_pooling_engine_warms_up_only_what_it_runs(tiny_model_dir, monkeypatch):
    """A pooling engine's steps sample nothing and ask for no logprobs: warm-up compiles the
    greedy sampler alone and no prompt-logprobs program, and embedding afterwards compiles
    nothing."""
    from jaxserve.runner.step_programs import StepPrograms

    asked, variants = [], set()
    prompt_logprobs, variants_of = StepPrograms.prompt_logprobs, warmup.sampler_variants
    monkeypatch.setattr(StepPrograms, "prompt_logprobs", lambda self, *a: asked.append(a)
                        or prompt_logprobs(self, *a))

    def spy(runner, dummy):
        pairs = variants_of(runner, dummy)
        variants.update(v for _, v in pairs)
        return pairs

    monkeypatch.setattr(warmup, "sampler_variants", spy)
    llm = LLM(tiny_model_dir, runner="pooling", **TINY_ENGINE)
    assert llm.engine.runner.warmup_progress[0] == len(BUCKETS)
    assert not asked and variants == {"greedy"}
    out = llm.embed(["a b c", "The capital of France is " * 9], use_tqdm=False)
    assert len(out) == 2 and all(len(o.outputs.embedding) for o in out)
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0

"""The pooling runner's engine behaviour on the tiny Llama: chunked prefill and batching leave
each vector unchanged, Matryoshka `dimensions` and `normalize`, pages freed, recompute
preemption, and the errors (bad pooler settings, bad dimensions, each runner refusing the
other's requests)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, PoolerConfig, PoolingParams, SamplingParams
from tests.conftest import TINY_ENGINE

PROMPTS = ["The capital of France is",
           "A long walk through the old town, past the market and the church, then down "
           "to the harbour where the boats come in at dusk and the gulls wait on the "
           "masts for the fishermen to throw back what they cannot sell. " * 2,
           "def add(a, b):\n    return a + b",
           "Bonjour, comment allez-vous aujourd'hui ?"]

# NOTE: a MEAN vector is a float32 sum whose order follows how the step cut the prompt into
# chunks (each chunk summed on the device, the chunks added on the host), so a prompt cut
# differently in a batch differs by float32 rounding: ~1e-6 on elements of size ~1 (on a
# Zen 4 VM with AVX-512, XLA's code moved one element of one vector by 1.3e-6, where the
# Zen 3 VMs had stayed within 1e-6). A lost or doubled chunk moves the vector by ~1e-2.
SAME_SUM = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mean_llm(tiny_model_dir):
    """A MEAN-pooling engine (every chunk counts), not normalized by default."""
    return LLM(tiny_model_dir, runner="pooling",
               pooler_config=PoolerConfig(pooling_type="MEAN", normalize=False),
               warmup=False, **TINY_ENGINE)


@pytest.fixture(scope="module")
def alone(mean_llm):
    """Each prompt's vector embedded alone."""
    return [np.asarray(mean_llm.embed(p, use_tqdm=False)[0].outputs.embedding)
            for p in PROMPTS]


def test_a_batch_of_mixed_lengths_equals_each_prompt_alone(mean_llm, alone):
    outs = mean_llm.embed(PROMPTS * 2, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs[:4]] == [o.prompt_token_ids for o in outs[4:]]
    for out, want in zip(outs, alone * 2, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, want, **SAME_SUM)
    stats = mean_llm.engine.kv.stats()
    assert stats.num_used_pages == 0 and stats.num_free_pages == stats.num_total_pages


def test_chunks_of_16_tokens_give_the_same_vector(tiny_model_dir, alone):
    llm = LLM(tiny_model_dir, runner="pooling", long_prefill_token_threshold=16,
              pooler_config={"pooling_type": "MEAN", "normalize": False}, warmup=False,
              **TINY_ENGINE)
    steps = llm.engine.counters["num_steps"]
    (out,) = llm.embed(PROMPTS[1], use_tqdm=False)
    assert len(out.prompt_token_ids) > 64
    # one step per chunk of 16 (the engine reports a step's outputs one step later)
    assert llm.engine.counters["num_steps"] - steps >= len(out.prompt_token_ids) // 16
    np.testing.assert_allclose(out.outputs.embedding, alone[1], **SAME_SUM)


def test_recompute_preemption_restarts_the_sum(tiny_model_dir, alone):
    # 12 pages of 16 slots: the four prompts do not all fit, so some are preempted and
    # recomputed from token 0 (their sums restart).
    sizes = {**TINY_ENGINE, "num_kv_blocks": 12}
    llm = LLM(tiny_model_dir, runner="pooling", preemption_mode="recompute",
              pooler_config={"pooling_type": "MEAN", "normalize": False}, warmup=False,
              **sizes)
    outs = llm.embed(PROMPTS[1:2] * 3 + PROMPTS, use_tqdm=False)
    assert llm.get_metrics()["jaxserve:num_preemptions"] > 0
    for out, want in zip(outs, alone[1:2] * 3 + alone, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, want, **SAME_SUM)


def test_dimensions_truncate_then_normalize(mean_llm, alone):
    full, cut, raw_cut = mean_llm.embed(
        [PROMPTS[0]] * 3, [PoolingParams(normalize=True), PoolingParams(dimensions=16,
                                                                        normalize=True),
                           PoolingParams(dimensions=16)], use_tqdm=False)
    want = alone[0]
    np.testing.assert_allclose(full.outputs.embedding, want / np.linalg.norm(want),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cut.outputs.embedding, want[:16] / np.linalg.norm(want[:16]),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(raw_cut.outputs.embedding, want[:16], rtol=1e-5, atol=1e-6)


def test_errors_name_the_problem(mean_llm, tiny_model_dir):
    hidden = mean_llm.engine.model.cfg.hidden_size
    with pytest.raises(ValueError, match=f"dimensions=1000 exceeds the model's hidden size "
                                         f"{hidden}"):
        mean_llm.embed(PROMPTS[:2], PoolingParams(dimensions=1000), use_tqdm=False)
    assert not mean_llm.engine.states  # nothing of the batch left queued
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="normalize must be"):
        PoolingParams(normalize="yes")
    with pytest.raises(ValueError, match="pooling runner .*takes PoolingParams, not "
                                         "SamplingParams"):
        mean_llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request: the pooling runner serves no LoRA"):
        mean_llm.engine.add_request("lora-1", PROMPTS[0], PoolingParams(),
                                    lora_request=object())
    with pytest.raises(ValueError, match="got 1 pooling_params for 2 prompts"):
        mean_llm.embed(PROMPTS[:2], [PoolingParams()], use_tqdm=False)
    generate = LLM(tiny_model_dir, warmup=False, **TINY_ENGINE)
    with pytest.raises(ValueError, match="generate runner: embeddings .* need an engine with "
                                         "runner='pooling'"):
        generate.embed(PROMPTS[0], use_tqdm=False)
    assert not generate.engine.states


@pytest.mark.parametrize("kwargs, match", [
    (dict(runner="embed"), "runner must be one of"),
    (dict(task="classify"), "task must be one of"),
    (dict(task="generate", runner="pooling"), "task='generate' contradicts runner='pooling'"),
    (dict(pooler_config={"pooling_type": "MAX"}), "pooling_type must be one of"),
    (dict(pooler_config={"pooling": "MEAN"}), r"pooler_config: unknown field.s. \[.pooling.\]"),
    (dict(pooler_config="{not json"), "pooler_config: not valid JSON"),
    (dict(pooler_config={}, override_pooler_config={}), "both given"),
    (dict(pooler_config={"dimensions": -1}), "dimensions must be a positive integer"),
])
def test_bad_pooler_settings_are_value_errors(kwargs, match):
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_default_dimensions_above_the_hidden_size_fail_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match="dimensions=100 exceeds the model's hidden size 72"):
        LLM(tiny_model_dir, runner="pooling", pooler_config={"dimensions": 100},
            warmup=False, **TINY_ENGINE)


def test_a_warmed_up_pooling_engine_compiles_nothing_while_embedding(tiny_model_dir, alone):
    llm = LLM(tiny_model_dir, runner="pooling", pooler_config={"pooling_type": "MEAN",
                                                               "normalize": False},
              **TINY_ENGINE)  # warm-up runs every bucket's pooling program too
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0
    for out, want in zip(outs, alone, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, want, **SAME_SUM)


def test_serve_flags_select_the_pooling_runner():
    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--runner", "pooling", "--pooler-config",
                                      '{"pooling_type": "CLS", "normalize": false}'])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.model.runner == "pooling"
    assert config.model.pooler_config == PoolerConfig("CLS", normalize=False)
    args = build_parser().parse_args(["serve", "--task", "embed"])
    assert EngineConfig.from_kwargs(**engine_kwargs(args)).model.runner == "pooling"

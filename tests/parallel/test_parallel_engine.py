"""Tensor and data parallelism on 8 CPU devices: same greedy tokens as one device, no
recompiles after warm-up, the expected collectives and no page-pool gather.

The engines run tiny random models (SmolLM2's head counts where the split matters): what is
checked is the sharding and the placement, not the weights, and each engine compiles its
own programs (a full-model engine cost ~40 s of this 2-core machine per layout)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.parallel.layouts import make_tensor_parallel
from models.config import ArchConfig
from models.model import Model, random_params
from pallas_kernels import cpu_ffi

GREEDY = SamplingParams(temperature=0, max_tokens=12, detokenize=False)
# Untied LM head with a vocabulary that 2 and 4 divide, so the head is vocabulary-split.
TINY = ArchConfig("LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=512, eos_token_ids=(2,))
# NOTE: a 16-token budget (prompts are chunked): three token buckets (4, 8 and 16: the XLA
# path's smallest is 4) where the engine default makes more (a model step is ~5 s to compile
# here); warm-up over several buckets is tested on one device (tests/e2e). An 8-token budget
# (two buckets) measured no faster: its extra steps on the mesh cost what the compile saved.
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")


@pytest.fixture(scope="module")
def tiny_model():
    params = jax.tree_util.tree_map(lambda x: x * 3.0, random_params(TINY, seed=3))
    return Model(TINY, params)


def _tiny_prompts():
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": [int(t) for t in rng.integers(3, 256, n)]}
            for n in (5, 17, 33, 9, 48)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model, smollm2_tokenizer):
    """One device's greedy tokens (no warm-up: it compiles only the steps it runs)."""
    llm = LLM(tiny_model, tokenizer=smollm2_tokenizer, num_kv_blocks=64, warmup=False, **SMALL)
    return _tokens(llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False))


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tiny_tensor_parallel_matches_one_device(tiny_model, smollm2_tokenizer, tiny_reference,
                                                 size):
    # 12 pages force preemption; at size 4 the 2 KV heads are replicated in pairs.
    llm = LLM(tiny_model, tokenizer=smollm2_tokenizer, tensor_parallel_size=size,
              num_kv_blocks=12, **SMALL)
    assert _tokens(llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False)) == tiny_reference
    metrics = llm.get_metrics()
    assert metrics["jaxserve:num_preemptions"] > 0
    assert metrics["jaxserve:num_compilations"] == 0
    layout = llm.engine.layout
    assert layout.size == size and layout.shard_kv_heads == (size == 2)
    # The CPU's C++ decode kernel reads one device's pool: a mesh serves on the XLA path.
    assert llm.engine.runner.model.serving.backend == "xla"
    pool = llm.engine.runner.kv_pages
    assert pool.sharding.spec[2] == "kv" and len(pool.sharding.device_set) == size
    _check_collectives(llm)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_tensor_parallelism(tiny_model, smollm2_tokenizer, tiny_reference,
                                              method):
    """Proposals verified by a tp=2 target (n-gram, or the tiny model itself as a draft on
    one device): the one-device greedy tokens."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = tiny_model
    llm = LLM(tiny_model, tokenizer=smollm2_tokenizer, tensor_parallel_size=2,
              num_kv_blocks=64, warmup=False, speculative_config=spec, **SMALL)
    llm.engine.speculator.gate.min_acceptance = 0.0  # propose every step, however few hold
    assert _tokens(llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False)) == tiny_reference
    metrics = llm.get_metrics()
    assert metrics["jaxserve:spec_decode_num_draft_tokens"] > 0  # verified on the mesh
    if method == "draft_model":  # the target itself proposes: its own greedy tokens
        assert metrics["jaxserve:spec_decode_num_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def tiny9(tiny_model_dir):
    """The conftest's tiny Llama (SmolLM2's 9 query / 3 KV heads and 49152-token vocabulary,
    so tensor-parallel size 3 splits heads, KV heads and vocabulary as on SmolLM2), weights
    scaled for sharper logits (greedy choices are not near-ties)."""
    from models.loaders import load_model

    model = load_model(tiny_model_dir, "float32")
    return Model(model.cfg, jax.tree_util.tree_map(lambda x: x * 3.0, model.params))


@pytest.fixture(scope="module")
def tiny9_reference(tiny9, smollm2_tokenizer):
    llm = LLM(tiny9, tokenizer=smollm2_tokenizer, num_kv_blocks=64, warmup=False, **SMALL)
    return _tokens(llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False))


@pytest.mark.slow
def test_tp3_under_preemption_and_mixed_load(tiny9, smollm2_tokenizer, tiny9_reference):
    # 6 usable pages for five requests of 2-4 pages each: swapped out and back in.
    llm = LLM(tiny9, tokenizer=smollm2_tokenizer, tensor_parallel_size=3, num_kv_blocks=7,
              preemption_mode="swap", **SMALL)
    assert llm.engine.layout.size == 3 and llm.engine.layout.shard_kv_heads
    assert _tokens(llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False)) == tiny9_reference
    # A mixed workload after warm-up compiles nothing under tensor parallelism either.
    llm.generate(_tiny_prompts()[:3], [
        SamplingParams(temperature=0.8, seed=1, max_tokens=6),
        SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=6),
        SamplingParams(logprobs=3, max_tokens=6, repetition_penalty=1.2)], use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["jaxserve:num_swap_outs"] > 0
    assert metrics["jaxserve:num_compilations"] == 0
    _check_collectives(llm)


def _check_collectives(llm):
    """The compiled step all-reduces after row-parallel layers and never gathers the pool."""
    runner = llm.engine.runner
    ((layout, _), step), *_ = runner.programs.model_steps().items()
    buf = jax.device_put(np.zeros(layout.size, np.int32), llm.engine.layout.replicated())
    prev_ids = runner.no_prev_ids
    hlo = step.lower(runner.params, runner.kv_pages, buf, prev_ids).compile().as_text()
    assert len(re.findall(r"all-reduce\(", hlo)) >= 2  # attention out + MLP down, per layer
    pool = runner.kv_pages.shape
    pool_dims = ",".join(str(d) for d in pool)
    for line in hlo.splitlines():
        if "all-gather(" in line:
            assert f"[{pool_dims}]" not in line, line


# NOTE: warmed up (both replicas compile every bucket) in the slow tier only.
@pytest.mark.parametrize("warmup", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_data_parallel_two_replicas(tiny_model, smollm2_tokenizer, tiny_reference, warmup):
    llm = LLM(tiny_model, tokenizer=smollm2_tokenizer, data_parallel_size=2, num_kv_blocks=64,
              warmup=warmup, **SMALL)
    engine = llm.engine
    prompts = _tiny_prompts()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    # Least-queued placement spreads the requests over both replicas.
    assert {engine.replica_of(f"r{i}") for i in range(len(prompts))} == {0, 1}
    devices = {next(iter(r.runner.kv_pages.sharding.device_set)).id for r in engine.replicas}
    assert devices == {0, 1}
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(len(prompts))] == tiny_reference
    if warmup:
        assert llm.get_metrics()["jaxserve:num_compilations"] == 0


def test_data_parallel_loads_the_weights_as_one_engine_does(tiny_model_dir):
    """Replicas of a model given by path are loaded like a single engine's (`load_weights`):
    quantization included (it was once dropped, leaving float weights). Sleep and partial
    wake-up reach every replica: the front end sleeps until each has every tag awake."""
    llm = LLM(tiny_model_dir, data_parallel_size=2, quantization="int8", num_kv_blocks=16,
              warmup=False, **SMALL)
    replicas = llm.engine.replicas
    assert [r.model.quant.name for r in replicas] == ["int8", "int8"]
    assert llm.sleep(level=1) == sum(r.limits.num_pages * r.limits.bytes_per_page
                                     for r in replicas)
    with pytest.raises(ValueError, match="unknown memory tag"):
        llm.wake_up(tags=["weights", "kv"])
    assert all(r.weights.sleeping_tags == {"weights", "kv_cache"} for r in replicas)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and all(r.is_sleeping() for r in replicas)
    assert [r.runner.kv_pages for r in replicas] == [None, None]
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert all(r.runner.kv_pages is not None for r in replicas)


def test_bad_sizes_are_clear_errors(smollm2, smollm2_tokenizer):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_heads=9"):
        LLM(smollm2, tokenizer=smollm2_tokenizer, tensor_parallel_size=2, **SMALL)
    with pytest.raises(ValueError, match="needs 16 devices; 8 available"):
        LLM(smollm2, tokenizer=smollm2_tokenizer, data_parallel_size=2, tensor_parallel_size=8,
            **SMALL)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(smollm2, tokenizer=smollm2_tokenizer, tensor_parallel_size=0, **SMALL)
    odd = ArchConfig("LlamaForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=64,
                     num_layers=1, num_heads=12, num_kv_heads=3, head_dim=4)
    with pytest.raises(ValueError, match="and num_kv_heads=3 must divide one another"):
        make_tensor_parallel(odd, 2)


@pytest.mark.skipif(not cpu_ffi.available(), reason="no CPU decode kernel here")
def test_cpu_backend_under_tensor_parallelism_is_an_error(tiny_model, smollm2_tokenizer):
    with pytest.raises(ValueError, match="attention_backend 'cpu' serves one device's page "
                                         "pool; with tensor_parallel_size 2 use 'xla'"):
        LLM(tiny_model, tokenizer=smollm2_tokenizer, tensor_parallel_size=2,
            attention_backend="cpu", num_kv_blocks=12, **SMALL)


def test_checkpoint_restores_straight_into_shards(tiny_model, smollm2_tokenizer,
                                                  tiny_reference, tmp_path):
    from models.loaders.orbax_ckpt import save_checkpoint

    ckpt = str(tmp_path / "tiny")
    save_checkpoint(ckpt, TINY, tiny_model.params, "float32", None)
    llm = LLM(ckpt, tokenizer=smollm2_tokenizer, tensor_parallel_size=4, warmup=False,
              **SMALL)
    q = llm.engine.model.params["layers"]["self_attn"]["q_proj"]["kernel"]  # [L, D, Hq*hd]
    assert len(q.sharding.device_set) == 4
    assert {s.data.shape for s in q.addressable_shards} == {(2, 64, 16)}  # a quarter each
    # The default CPU pool (kv_cache_memory_gib=1) is host memory for all shards together,
    # the two replicated copies of each KV head included.
    kv = llm.engine.runner.kv_pages
    host_bytes = sum(s.data.nbytes for s in kv.addressable_shards)
    assert 0.9 * 2**30 < host_bytes <= 2**30
    assert _tokens(llm.generate(_tiny_prompts(), GREEDY, use_tqdm=False)) == tiny_reference

"""LoRA adapters served per request: every request's greedy tokens equal the PEFT-merged
model's (transformers), alone and mixed in one batch with the base, through chunked
prefill, the prefix cache, preemption and tensor parallelism; more adapters than slots
wait for one, never fail, never recompile."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from pallas_kernels.cpu_ffi import lora as kernel
from tests.conftest import TINY_ENGINE
from tests.lora.adapters import hf_greedy, load_hf, make_adapters

pytest.importorskip("peft")

MAX_TOKENS = 8
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    # Longer than the 64-token step budget: prefilled in chunks.
    " ".join(["Here is a long list of fruits and vegetables that people grow in gardens:",
              "apples, pears, plums, cherries, carrots, onions, leeks, beans, peas, kale,"] * 3),
]
FIFTH = {"fifth": dict(r=8, lora_alpha=8, target_modules=["v_proj", "up_proj"])}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """The four adapters of `ADAPTER_CONFIGS` (ids 1-4) and a fifth (id 5), with the base
    model: name -> `Adapter` (the base under "base", without a path)."""
    from tests.lora.adapters import Adapter

    base = load_hf(tiny_model_dir)
    root = str(tmp_path_factory.mktemp("adapters"))
    found = make_adapters(base, root)
    found.update(make_adapters(base, root, FIFTH, first_id=5))
    return {"base": Adapter("base", 0, "", base), **found}


@pytest.fixture(scope="module")
def oracle(adapters, smollm2_tokenizer):
    """(adapter name, prompt index) -> the merged model's greedy tokens."""
    return {(name, i): hf_greedy(a.merged, smollm2_tokenizer, prompt, MAX_TOKENS)
            for name, a in adapters.items() for i, prompt in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """Four adapter slots, four adapters kept on the host (a fifth evicts one), warmed up."""
    return LLM(tiny_model_dir, enable_lora=True, max_loras=4, max_lora_rank=16,
               max_cpu_loras=4, **TINY_ENGINE)


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm, cases, adapters, max_tokens=MAX_TOKENS):
    """Generates `cases` ((adapter name, prompt index) pairs) as one batch; their tokens."""
    outs = llm.generate([PROMPTS[i] for _, i in cases], greedy(max_tokens), use_tqdm=False,
                        lora_request=[adapters[n].request() if n != "base" else None
                                      for n, _ in cases])
    return [list(o.outputs[0].token_ids) for o in outs]


def test_each_adapter_alone_equals_its_merged_model(llm, adapters, oracle):
    # the default form: the CPU LoRA kernel where it builds
    served = llm.engine.runner.model.serving
    assert served.lora_impl == ("grouped" if kernel.available() else "masked")
    for name in ("base", "qv8", "mlp4", "all16", "ko2"):
        assert run(llm, [(name, 0)], adapters) == [oracle[(name, 0)]], name
    assert len({tuple(oracle[(n, 0)]) for n in ("base", "qv8", "mlp4", "all16", "ko2")}) == 5


def test_mixed_batch_with_chunked_prefill_equals_every_merged_model(llm, adapters, oracle):
    cases = [(n, i) for n in ("base", "qv8", "mlp4", "all16", "ko2") for i in range(3)]
    assert run(llm, cases, adapters) == [oracle[c] for c in cases]
    assert llm.engine.runner.num_compilations == 0


def test_prefix_cache_keeps_adapters_apart(llm, adapters, smollm2_tokenizer):
    """A new long prompt under one adapter, then another: the second finds no cached page
    of the first's (nor does the base); run again under the first, it hits its own pages;
    every run keeps its merged model's tokens."""
    prompt = "Tomatoes first. " + PROMPTS[2]
    runs = [(name, llm.generate(prompt, greedy(), use_tqdm=False,
                                lora_request=adapters[name].request() if name != "base"
                                else None)[0])
            for name in ("qv8", "ko2", "base", "qv8")]
    assert [out.num_cached_tokens for _, out in runs[:3]] == [0, 0, 0]
    assert runs[3][1].num_cached_tokens >= 64
    for name, out in runs:
        assert list(out.outputs[0].token_ids) == hf_greedy(
            adapters[name].merged, smollm2_tokenizer, prompt, MAX_TOKENS), name


def test_a_fifth_adapter_waits_for_a_slot_and_nothing_recompiles(llm, adapters, oracle):
    """Five adapters for four slots (and four host places): the scheduler never runs more
    than four at once, the fifth waits and takes a freed slot, the one evicted from the
    host is read again from its path; every output equals its oracle."""
    engine = llm.engine
    names = ["qv8", "mlp4", "all16", "ko2", "fifth", "qv8", "base"]
    loads = engine.runner.lora.manager.num_loads
    writes = engine.runner.lora.num_writes
    for k, name in enumerate(names):
        engine.add_request(f"five-{k}", PROMPTS[k % 2], greedy(MAX_TOKENS + 4 * (k < 4)),
                           lora_request=adapters[name].request() if name != "base" else None)
    done, most = {}, 0
    while engine.has_unfinished_requests():
        running = {r.lora_id for r in engine.scheduler.running if r.lora_id}
        most = max(most, len(running))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert most == 4
    for k, name in enumerate(names):
        want = oracle[(name, k % 2)]
        assert done[f"five-{k}"][:len(want)] == want, (k, name)
    assert engine.runner.lora.num_writes > writes  # the fifth took a slot
    assert 5 in engine.runner.lora.manager.slots
    assert engine.runner.lora.manager.num_loads > loads  # re-read after its eviction
    assert engine.runner.num_compilations == 0
    assert engine.kv.usage == 0  # no page leaks


# NOTE: both modes in the slow tier (16 s of an engine with a small pool); in the default
# tier the fifth-adapter case evicts and re-reads adapters under load, and
# tests/core/test_scheduler_lora.py holds the scheduler's adapter rule.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_requests_adapter(tiny_model_dir, adapters, smollm2_tokenizer,
                                                mode):
    """A pool too small for the batch: requests are preempted and come back with their
    own adapter."""
    llm = LLM(tiny_model_dir, enable_lora=True, max_loras=4, max_lora_rank=16,
              preemption_mode=mode, swap_space=0.01, warmup=False,
              **{**TINY_ENGINE, "num_kv_blocks": 14})
    names = ["base", "qv8", "mlp4", "all16", "ko2", "qv8"]
    cases = [(n, 1) for n in names]
    got = run(llm, cases, adapters, max_tokens=40)
    want = {n: hf_greedy(adapters[n].merged, smollm2_tokenizer, PROMPTS[1], 40)
            for n in set(names)}
    assert got == [want[n] for n in names]
    assert llm.get_metrics()["jaxserve:num_preemptions"] > 0


@pytest.mark.slow
def test_tensor_parallel_adapters_equal_their_merged_models(smollm2_path, smollm2_tokenizer,
                                                            tmp_path):
    """Over two devices (a tiny model of 4 query / 2 KV heads, which 2 divides), the slot
    stacks split like the base weights; every adapter's tokens equal its merged model's."""
    from models.loaders.gguf_file import open_gguf
    from tests.conftest import write_tiny_hf_dir

    model_dir = write_tiny_hf_dir(str(tmp_path / "tp-model"), smollm2_tokenizer,
                                  open_gguf(smollm2_path).hf_config(), num_attention_heads=4,
                                  num_key_value_heads=2)
    adapters = make_adapters(load_hf(model_dir), str(tmp_path / "adapters"))
    llm = LLM(model_dir, enable_lora=True, max_loras=4, max_lora_rank=16,
              tensor_parallel_size=2, warmup=False, **TINY_ENGINE)
    stacks = llm.engine.runner.lora.stacks["layers"]
    assert len(stacks["self_attn"]["q_proj"]["b"].sharding.device_set) == 2
    assert not stacks["self_attn"]["q_proj"]["b"].sharding.is_fully_replicated
    assert not stacks["mlp"]["down_proj"]["a"].sharding.is_fully_replicated
    cases = [(n, i) for n in ("qv8", "mlp4", "all16", "ko2") for i in range(3)]
    got = run(llm, cases, adapters)
    assert got == [hf_greedy(adapters[n].merged, smollm2_tokenizer, PROMPTS[i], MAX_TOKENS)
                   for n, i in cases]


def test_chat_beam_search_and_async_take_the_adapter(llm, adapters, oracle, smollm2_tokenizer):
    """`chat`, `beam_search` (width 1: greedy) and `AsyncLLM.generate` run the request
    with its adapter: the merged model's tokens."""
    import asyncio

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.beam_search import BeamSearchParams

    qv8 = adapters["qv8"]
    beams = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS,
                                                           ignore_eos=True),
                            lora_request=qv8.request())
    prompt_ids = smollm2_tokenizer(PROMPTS[0])["input_ids"]
    assert beams[0].sequences[0].tokens[len(prompt_ids):] == oracle[("qv8", 0)]

    messages = [{"role": "user", "content": "Name a fruit."}]
    chat_ids = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    got = llm.chat(messages, greedy(), use_tqdm=False, lora_request=qv8.request())
    text = smollm2_tokenizer.decode(chat_ids)
    assert list(got[0].outputs[0].token_ids) == hf_greedy(qv8.merged, smollm2_tokenizer, text,
                                                          MAX_TOKENS)

    async def stream():
        engine = AsyncLLM(llm.engine, log_interval=0)
        try:
            final = None
            async for out in engine.generate(PROMPTS[1], greedy(), "async-lora",
                                             lora_request=adapters["ko2"].request()):
                final = out
            return list(final.outputs[0].token_ids)
        finally:
            engine.shutdown()

    assert asyncio.run(stream()) == oracle[("ko2", 1)]

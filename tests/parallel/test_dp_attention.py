"""Data-parallel attention with expert parallelism on 8 CPU devices: a tiny DeepSeek-V3
(latent attention, grouped sigmoid routing, a shared expert, a dense first layer) under
EP 2 and EP 4 with `enable_dp_attention` gives transformers' greedy tokens batched, chunked,
with a prefix hit, through recompute and swap preemption and with n-gram speculation; the
requests spread over the ranks; the compiled step never gathers the latent pool; every
setting it does not serve is a clear error. Plain tensor parallelism 2 (the latent pool on
both devices) gives the same tokens.

The oracle is transformers' `DeepseekV3ForCausalLM` (`hf_greedy`), the one-device engine's
(`tests/e2e/test_family_conformance.py`'s deepseek_v3 row holds it to the same).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.e2e.hf_family import PROMPTS, TINY, build_hf_model, hf_greedy

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
torch = pytest.importorskip("torch")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        detokenize=False)
DEEPSEEK = dict(TINY, num_hidden_layers=2, num_experts_per_tok=2, num_key_value_heads=4,
                kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=12, n_routed_experts=8, n_group=2, topk_group=1,
                moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
# Chunks of 16 tokens (two prompts are longer); 4 pages of 16 tokens per rank (3 usable):
# a request with its output takes 1-3 pages, so two on one rank preempt each other.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=8,
             attention_backend="xla", warmup=False, enable_dp_attention=True)


@pytest.fixture(scope="module")
def deepseek(smollm2_tokenizer, tmp_path_factory):
    """(path, prompts' token ids, transformers' greedy tokens of each)."""
    path = str(tmp_path_factory.mktemp("deepseek_dp"))
    hf = build_hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK,
                        smollm2_tokenizer, path, 1.0)
    ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    # The third prompt again with more text: its first pages are a prefix hit.
    ids.append(ids[2] + smollm2_tokenizer.encode(" and the third one is")[1:])
    torch.set_num_threads(1)
    return path, ids, [hf_greedy(hf, x, MAX_TOKENS) for x in ids]


@pytest.fixture(scope="module")
def ep2(deepseek):
    return LLM(deepseek[0], expert_parallel_size=2, **SMALL)


def _generate(llm, ids):
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_ep2_spreads_requests_and_equals_transformers(ep2, deepseek):
    _, ids, expected = deepseek
    engine = ep2.engine
    # Batched, chunked (16-token chunks), preempted (a rank's 3 pages hold fewer requests).
    for i, x in enumerate(ids[:3]):
        engine.add_request(str(i), {"prompt_token_ids": x}, GREEDY)
    ranks, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        ranks.update({str(i): engine.kv.rank_of(str(i)) for i in range(3)
                      if engine.kv.has_request(str(i))})
    assert [tokens[str(i)] for i in range(3)] == expected[:3]
    assert set(ranks.values()) == {0, 1}  # the requests were spread over both ranks
    metrics = ep2.get_metrics()
    assert metrics["jaxserve:num_preemptions"] > 0
    # The third prompt's pages stay cached on its rank; the fourth, alone, hits them.
    assert _generate(ep2, ids[3:]) == expected[3:]
    assert ep2.get_metrics()["jaxserve:prefix_cache_hits"] > metrics[
        "jaxserve:prefix_cache_hits"]


def test_the_latent_pool_is_split_and_never_gathered(ep2):
    runner = ep2.engine.runner
    pool = runner.page_pool  # [L, 1, 1, pages, page_size, R + Dr]
    assert pool.sharding.spec[3] == "expert"
    assert {s.data.shape[3] for s in pool.addressable_shards} == {pool.shape[3] // 2}
    (layout, _), step = next(iter(runner.programs.model_steps().items()))
    buf = jax.device_put(np.zeros(layout.size, np.int32), ep2.engine.layout.replicated())
    hlo = step.lower(runner.params, runner.kv_pages, buf,
                     runner.no_prev_ids).compile().as_text()
    shapes = {",".join(map(str, pool.shape)), ",".join(map(str, pool.shape[1:]))}
    gathers = [line for line in hlo.splitlines() if re.search(r"all-gather(-start)?\(", line)]
    assert gathers  # the tokens travel to the experts
    for line in gathers:
        assert not any(f"[{s}]" in line for s in shapes), line


@pytest.mark.slow  # two more engines' programs (EP 4 over 4 ranks, warmed up; swap)
@pytest.mark.parametrize("args", [dict(expert_parallel_size=4, num_kv_blocks=16, warmup=True),
                                  dict(expert_parallel_size=2, preemption_mode="swap")],
                         ids=["ep4", "ep2_swap"])
def test_other_layouts_equal_transformers(deepseek, args):
    path, ids, expected = deepseek
    llm = LLM(path, **{**SMALL, **args})
    compiled = llm.get_metrics()["jaxserve:num_compilations"]
    assert _generate(llm, ids) == expected  # EP 4: a request per rank
    if args.get("warmup"):  # warm-up compiled every rank-blocked bucket's programs
        assert llm.get_metrics()["jaxserve:num_compilations"] == compiled
    if args.get("preemption_mode") == "swap":
        metrics = llm.get_metrics()
        assert metrics["jaxserve:num_preemptions"] > 0
        assert metrics["jaxserve:num_swap_outs"] > 0


@pytest.mark.slow  # another engine's programs (default tier: the layout's specs in
# tests/models/test_deepseek.py)
def test_plain_tensor_parallel_2_replicates_the_latents(deepseek):
    """Plain tensor parallelism stays available: query heads split, the latent pool whole
    on both devices."""
    path, ids, expected = deepseek
    args = {k: v for k, v in SMALL.items() if k != "enable_dp_attention"}
    llm = LLM(path, tensor_parallel_size=2, **{**args, "num_kv_blocks": 16})
    assert _generate(llm, ids) == expected
    pool = llm.engine.runner.page_pool
    assert {s.data.shape for s in pool.addressable_shards} == {pool.shape}


@pytest.mark.slow  # another engine's programs (verification steps)
def test_ngram_speculation_equals_transformers(deepseek, smollm2_tokenizer):
    path, ids, expected = deepseek
    # transformers' greedy text after this prompt loops ("interfaces trich interfaces ..."):
    # proposals are made, some accepted.
    looping = smollm2_tokenizer.encode("one two one two one two")
    llm = LLM(path, expert_parallel_size=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
        **{**SMALL, "num_kv_blocks": 16})
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert _generate(llm, [looping, *ids[:2]]) == [hf_greedy(hf, looping, MAX_TOKENS),
                                                  *expected[:2]]
    assert llm.get_metrics()["jaxserve:spec_decode_num_accepted_tokens"] > 0


def test_unserved_settings_are_clear_errors(deepseek, tiny_model_dir):
    path = deepseek[0]
    cases = [
        (dict(enable_dp_attention=True), "used with an expert_parallel_size over 1"),
        (dict(enable_dp_attention=True, expert_parallel_size=2, tensor_parallel_size=2),
         "used with tensor_parallel_size=1"),
        (dict(enable_dp_attention=True, expert_parallel_size=2, enable_lora=True),
         "does not serve enable_lora"),
        (dict(enable_dp_attention=True, expert_parallel_size=2,
              enable_return_routed_experts=True), "does not serve enable_return_routed_experts"),
        (dict(enable_dp_attention=True, expert_parallel_size=2, num_kv_blocks=25),
         "num_kv_blocks=25 must be a multiple of the 2 attention ranks"),
    ]
    base = {k: v for k, v in SMALL.items() if k not in ("enable_dp_attention", "num_kv_blocks")}
    for args, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            LLM(path, **{"num_kv_blocks": 8, **base, **args})
    with pytest.raises(ValueError, match="enable_dp_attention needs a mixture-of-experts"):
        LLM(tiny_model_dir, enable_dp_attention=True, expert_parallel_size=2,
            **{k: v for k, v in base.items()})

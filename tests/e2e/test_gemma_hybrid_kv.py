"""Gemma 2 and 3 served with the hybrid KV cache equal transformers' greedy tokens under
chunked prefill, prefix hits, both preemption modes and n-gram speculation, and the
sliding groups' pages go back while a request decodes."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import TINY, build_hf_model, hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_TOKENS = 16
PROMPTS = [
    "Paged attention stores the key and value cache in fixed-size blocks, and the "
    "scheduler decides which requests advance at every step of the engine",
    "Once upon a time there was a small engine that served many requests",
    "The three primary colors are red, yellow and blue; mixing two of them gives",
    "Sliding windows keep only the most recent keys, so old pages can be given back",
]
# SmolLM2's vocabulary; windows of 8 tokens over pages of 8, so a page leaves a sliding
# group's window every 8 tokens. Two layer patterns per family.
BASE = dict(**TINY, head_dim=16, sliding_window=8)
ROPE3 = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
FAMILIES = {
    "gemma2-alternating": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=4, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
        final_logit_softcapping=4.0)),
    "gemma2-two-sliding": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=3, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "gemma3-pattern3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, query_pre_attn_scalar=16, sliding_window_pattern=3,
        final_logit_softcapping=4.0, rope_parameters=ROPE3)),
    "gemma3-pattern2": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, query_pre_attn_scalar=16, sliding_window_pattern=2,
        rope_parameters=ROPE3)),
}
ENGINE = {**TINY_ENGINE, "warmup": False, "block_size": 8, "max_num_batched_tokens": 16}
# Few pages (null page included): two requests of ~41 tokens hold 8-14 pages each (the
# layouts have 2-3 groups), so the four cannot all hold their KV at once.
SMALL_POOL = {"num_kv_blocks": 18, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def families(smollm2_tokenizer, tmp_path_factory):
    """name -> (directory, prompt ids, transformers' greedy tokens for each prompt), built
    on first use."""
    built = {}

    def get(name: str):
        if name not in built:
            directory = str(tmp_path_factory.mktemp(name))
            config_cls, model_cls, extra = FAMILIES[name]
            hf = build_hf_model(config_cls, model_cls, {**BASE, **extra}, smollm2_tokenizer,
                                directory, norm_center=0.0)  # 1 + weight must matter
            ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
            built[name] = directory, ids, [hf_greedy(hf, x, MAX_TOKENS) for x in ids]
        return built[name]

    return get


def _cases(default: list[str]):
    """Every family; those not in `default` in the slow tier (each case builds an engine)."""
    return [f if f in default else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


def _greedy(llm: LLM, ids) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _gained(llm: LLM, before: dict, name: str) -> float:
    return llm.get_metrics()[f"jaxserve:{name}"] - before[f"jaxserve:{name}"]


# The default tier runs the pages test here; swap preemption, prefix hits and chunks at once
# on Gemma 3's three groups (pages of 16, an 8-token budget) are the gemma3 row of
# tests/e2e/test_family_conformance.py (its gemma2 row runs in the slow tier). Every layout
# and mode (pages of 8, the window's size), and n-gram speculation, in the slow tier.
@pytest.mark.slow
@pytest.mark.parametrize("name,mode", [(f, m) for f in FAMILIES for m in ("recompute", "swap")])
def test_chunks_prefix_hits_and_preemption(families, name, mode):
    directory, ids, want = families(name)
    llm = LLM(directory, **{**ENGINE, **SMALL_POOL}, preemption_mode=mode, swap_space=0.01)
    assert llm.engine.runner.kv_layout.is_hybrid
    assert min(len(x) for x in ids) > BASE["sliding_window"]
    before = llm.get_metrics()
    assert _greedy(llm, ids[:1]) == want[:1]  # alone
    assert _greedy(llm, ids) == want  # batched, preempted
    assert _greedy(llm, ids) == want  # again, from prefix hits
    assert _gained(llm, before, "num_preemptions") > 0
    assert _gained(llm, before, "prefix_cache_hits") > 0
    if mode == "swap":
        assert _gained(llm, before, "num_swap_outs") > 0
    assert llm.get_metrics()["jaxserve:kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("name", _cases([]))
def test_ngram_speculation(families, name):
    directory, ids, want = families(name)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}
    llm = LLM(directory, **ENGINE, speculative_config=spec)
    assert _greedy(llm, ids) == want
    if name != "gemma3-pattern2":  # NOTE: its random model never repeats a token: no drafts
        assert llm.get_metrics()["jaxserve:spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("name", _cases(["gemma2-two-sliding"]))
def test_pages_go_back_during_a_long_decode(families, name):
    directory, ids, _ = families(name)
    llm = LLM(directory, **ENGINE)
    engine, kv = llm.engine, llm.engine.kv
    assert kv.num_groups > 1 and min(kv.group_windows) == 0
    engine.add_request("long", {"prompt_token_ids": ids[0]},
                       SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    held, sliding_dropped = [], False
    while engine.has_unfinished_requests():
        engine.step()
        if kv.has_request("long"):
            held.append(kv.pool.num_used_pages)
            tables = [kv.page_ids("long", g) for g in range(kv.num_groups)]
            sliding_dropped |= any(t[0] == 0 for g, t in enumerate(tables)
                                   if kv.group_windows[g])
    assert sliding_dropped
    # Per 8 tokens, each full group takes a page; each sliding group takes one and gives
    # one back (holding 2 or 3 pages as the boundaries fall), so growth is the full
    # groups' alone.
    num_full = sum(1 for w in kv.group_windows if w == 0)
    half = len(held) // 2
    assert held[-1] - held[half] <= num_full * ((len(held) - half) // 8 + 1) + (
        kv.num_groups - num_full)
    assert max(held) < num_full * (len(held) // 8 + 6) + 4 * (kv.num_groups - num_full)
    assert kv.usage == 0.0 and kv.pool.num_used_pages == 0


# NOTE: slow tier (two engines, ~15 s each): the default tier's budget is spent.
@pytest.mark.slow
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_8bit_pages_in_the_hybrid_cache_equal_one_table(families, kv):
    """8-bit KV pages per group (each group's pool with its own scales), preempted by swap
    and hit by the prefix cache, give the tokens of the same 8-bit pages in one block table
    for every layer (`disable_hybrid_kv_cache_manager`): quantizing a token's K/V does not
    depend on which table holds its page."""
    directory, ids, _ = families("gemma3-pattern3")
    args = {**ENGINE, **SMALL_POOL, "kv_cache_dtype": kv, "preemption_mode": "swap",
            "swap_space": 0.01}
    hybrid = LLM(directory, **args)
    assert hybrid.engine.runner.kv_layout.is_hybrid
    before = hybrid.get_metrics()
    got = [_greedy(hybrid, ids[:1]), _greedy(hybrid, ids)]  # alone; then a prefix hit, swaps
    assert _gained(hybrid, before, "num_swap_outs") > 0
    assert _gained(hybrid, before, "prefix_cache_hits") > 0
    assert hybrid.get_metrics()["jaxserve:kv_cache_usage_perc"] == 0.0
    one = LLM(directory, **{**ENGINE, "kv_cache_dtype": kv},
              disable_hybrid_kv_cache_manager=True)
    assert not one.engine.runner.kv_layout.is_hybrid
    want = _greedy(one, ids)
    assert got == [want[:1], want]

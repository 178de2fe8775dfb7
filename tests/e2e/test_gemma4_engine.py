"""Gemma 4 through the engine beyond the conformance row: the KV-shared layers hold no pages
of their own (a page holds the non-shared layers only, counted from the pool), the sliding
layers' group gives pages back during a long decode, and greedy tokens equal transformers'
alone and batched. Slow: the default tier's Gemma 4 numerics are tests/models/test_numerics.py's."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner.sizing import page_bytes
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, TINY, build_hf_model, hf_greedy, long_decode

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow(reason="a Gemma 4 engine (~10-20 s); numerics are default")

WINDOW = 8  # one page of 8: a page leaves the sliding group's window every 8 tokens
# Sliding, full, sliding, full; the last two read layers 0 and 1's KV.
# The full layers' heads are twice as wide (as Gemma 4's 512 beside 256), and one KV head.
CONFIG = dict(TINY, num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
              layer_types=["sliding_attention", "full_attention"] * 2,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=49152,
              num_kv_shared_layers=2, attention_k_eq_v=True, use_double_wide_mlp=True,
              num_global_key_value_heads=1)
MAX_TOKENS = 16
ENGINE = {**TINY_ENGINE, "warmup": False, "block_size": 8, "max_num_batched_tokens": 16,
          "max_model_len": 256}


@pytest.fixture(scope="module")
def built(smollm2_tokenizer, tmp_path_factory):
    """(directory, the transformers model)."""
    path = str(tmp_path_factory.mktemp("gemma4"))
    hf = build_hf_model("Gemma4TextConfig", "Gemma4ForCausalLM", CONFIG, smollm2_tokenizer,
                        path, norm_center=1.0)
    return path, hf


@pytest.fixture(scope="module")
def llm(built):
    return LLM(built[0], **ENGINE)


def test_shared_layers_keep_no_pool_slot(llm):
    """A page holds the two non-shared layers only: one slot in each of the two groups
    (sliding, full), so its bytes are half those of the same model without sharing."""
    model = llm.engine.model
    layout = model.kv_groups
    assert model.cfg.attention_layers == (0, 1)
    assert layout.num_layers == 2 and layout.num_slots == 1 and layout.num_groups == 2
    # the pool's shape holds both kinds: the local layers' KV heads, the full layers' width
    heads, width = model.cfg.kv_pool_heads
    assert (heads, width) == (model.cfg.num_kv_heads, 32) and model.cfg.global_kv_heads == 1
    per_layer = 2 * heads * 8 * width * 4  # K and V, f32
    assert page_bytes(model, 8) == per_layer * layout.num_slots
    unshared = dataclasses.replace(model.cfg, kv_shared_layers=0, double_wide_mlp=False)
    assert len(unshared.attention_layers) == 4  # what sharing saves: two layers' KV


def test_greedy_equals_transformers_alone_and_batched(llm, built, smollm2_tokenizer):
    _, hf = built
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    want = [hf_greedy(hf, x, MAX_TOKENS) for x in ids]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for batch in (ids[:1], ids):
        outs = llm.generate([{"prompt_token_ids": x} for x in batch], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want[:len(batch)]
    assert all(len(set(w)) > 1 for w in want)


def test_pages_go_back_during_a_long_decode(llm, smollm2_tokenizer):
    """While one request decodes 120 tokens, the sliding group holds at most the window's
    pages, the full group one per 8 tokens, and the pool no more than those: the shared
    layers hold none of their own."""
    engine, kv = llm.engine, llm.engine.kv
    assert kv.num_groups == 2 and sorted(kv.group_windows) == [0, WINDOW]
    ids = smollm2_tokenizer(PROMPTS[0]).input_ids
    seen = long_decode(engine, ids, 120)
    most, used = seen["most"], seen["used"]
    full = kv.group_windows.index(0)
    sliding = 1 - full
    length = len(ids) + 120
    assert most[sliding] <= 3 < most[full]
    assert most[full] >= (length - 1) // 8  # every token's page kept
    assert used <= most[full] + 3  # the full group's pages, the window's few more
    assert kv.usage == 0.0 and kv.pool.num_used_pages == 0


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
def test_tensor_parallel_equals_transformers(built, smollm2_tokenizer):
    """TP 2: the pool's two KV heads one per device, the local layers' two KV heads split
    with them, the full layers' one KV head (repeated into the pool) split by columns."""
    _, hf = built
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    llm = LLM(built[0], **ENGINE, tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, x, MAX_TOKENS) for x in ids]

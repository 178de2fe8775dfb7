"""Gemma 4's MoE block (`enable_moe_block`) through the engine: greedy tokens equal
transformers' alone, batched, in chunks smaller than the prompt and on a prefix hit; expert
parallelism 2 splits the experts over two devices with the same tokens; int8 experts (a
quantization plan's `experts.*`) serve their dequantized weights. Slow: the default tier's
Gemma 4 MoE numerics are tests/models/test_numerics.py's gemma4_moe_block case."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import PROMPTS, TINY, build_hf_model, hf_greedy

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow(reason="Gemma 4 MoE engines (~10-20 s each); numerics are default")

# Sliding (8), full, sliding, full, keys as values on the full layers; a dense MLP of 96 and
# 4 experts of 32 (top 2) in every layer; the full layers' heads twice as wide, one KV head; no
# per-layer inputs nor shared KV (gemma-4-26B-A4B's layout).
CONFIG = dict(TINY, num_hidden_layers=4, head_dim=16, global_head_dim=32, sliding_window=8,
              num_global_key_value_heads=1,
              layer_types=["sliding_attention", "full_attention"] * 2,
              hidden_size_per_layer_input=0, attention_k_eq_v=True, enable_moe_block=True,
              num_experts=4, top_k_experts=2, moe_intermediate_size=32)
MAX_TOKENS = 16
# Chunks of 16 tokens: the first prompt (~20 tokens) is prefilled in two steps.
ENGINE = {**TINY_ENGINE, "warmup": False, "block_size": 8, "max_num_batched_tokens": 16,
          "max_model_len": 256}


@pytest.fixture(scope="module")
def built(smollm2_tokenizer, tmp_path_factory):
    """(directory, the transformers model, prompts' ids, its greedy tokens); the router's
    `scale` and `per_expert_scale` drawn apart from their ones."""
    path = str(tmp_path_factory.mktemp("gemma4_moe"))
    hf = build_hf_model("Gemma4TextConfig", "Gemma4ForCausalLM", CONFIG, smollm2_tokenizer,
                        path, norm_center=1.0)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path, safe_serialization=True)
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    return path, hf, ids, [hf_greedy(hf, x, MAX_TOKENS) for x in ids]


def _greedy(llm: LLM, ids, cached: list | None = None) -> list[list[int]]:
    """Greedy tokens of each prompt; `cached` gets each one's prompt tokens served from
    the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    if cached is not None:
        cached.extend(o.num_cached_tokens for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_transformers_alone_batched_chunked_and_cached(built):
    path, _, ids, want = built
    assert len(ids[0]) > ENGINE["max_num_batched_tokens"]  # prefilled in chunks
    llm = LLM(path, **ENGINE)
    assert llm.engine.model.cfg.num_experts == 4
    assert _greedy(llm, ids[:1]) == want[:1]  # alone
    assert _greedy(llm, ids) == want  # batched
    cached = []
    assert _greedy(llm, ids, cached) == want  # again: the prompts' pages from the prefix cache
    assert all(n >= 8 for n in cached), cached
    assert all(len(set(w)) > 1 for w in want)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices")
def test_expert_parallel_equals_transformers(built):
    """EP 2: two of the four experts of every layer per device, the dense MLP and router
    replicated; the tokens are transformers'."""
    path, _, ids, want = built
    llm = LLM(path, **ENGINE, expert_parallel_size=2)
    params = llm.engine.runner.params
    experts = params.get("params", params)["layers"]["mlp"]["experts"]
    assert len(experts["down_proj"].sharding.device_set) == 2
    assert experts["down_proj"].addressable_shards[0].data.shape[1] == 2  # [L, E / 2, I, H]
    assert _greedy(llm, ids) == want


def test_int8_experts_serve_their_dequantized_weights(built):
    """A plan quantizing the routed stacks (`experts.*`, int8: q8 leaves [L, E, ...]) runs
    the block as the float model whose experts are those leaves dequantized."""
    from models.loaders import load_model
    from models.model import Model
    from models.moe import dequantize_experts
    from models.quant import EXPERT_MODULES, QuantFormat, QuantPlan, quantize_params
    from tests.models.helpers import forward_logits

    path, _, ids, _ = built
    ref = load_model(path, "float32")
    plan = QuantPlan(tuple((m, QuantFormat("q8", 0)) for m in EXPERT_MODULES), "int8")
    params = quantize_params(ref.params, plan)
    experts = params["layers"]["mlp"]["experts"]
    assert experts["gate_proj"]["qweight"].shape == (4, 4, 64, 32)
    assert experts["gate_proj"]["qweight"].dtype == np.int8
    floats = dequantize_experts(experts)  # f32[L, E, K, N] each
    moved = np.abs(floats["up_proj"] - ref.params["layers"]["mlp"]["experts"]["up_proj"])
    assert moved.max() > 1e-4  # the codes are not the float weights
    layers = {**ref.params["layers"], "mlp": {**ref.params["layers"]["mlp"], "experts": floats}}
    dequantized = Model(ref.cfg, {**ref.params, "layers": layers})
    got = forward_logits(Model(ref.cfg, params, quant=plan), ids[0], page_size=8)
    np.testing.assert_allclose(got, forward_logits(dequantized, ids[0], page_size=8),
                               rtol=0, atol=1e-4)

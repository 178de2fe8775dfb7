"""Greedy generation of a tiny random Qwen3-MoE through the engine equals transformers'
`generate` (alone and batched, a prompt past the token budget chunked), and serving after
warm-up compiles nothing whatever the routing.

Slow tier only: the default tier serves the same model warmed up (the qwen3_moe row of
tests/e2e/test_family_conformance.py: transformers' tokens batched, chunked, from prefix
hits, swapped and speculated, each check compiling nothing after warm-up)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.linear import ServingChoice
from tests.conftest import TINY_ENGINE
from tests.e2e.test_family_conformance import family

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The shared tiny-engine sizes, warmed up (every bucket compiled before serving).
ENGINE_ARGS = {**TINY_ENGINE}
MAX_TOKENS = 10
PROMPTS = [
    "Paged attention stores the key and value cache in fixed-size blocks, and the "
    "scheduler decides which requests advance",
    "Once upon a time, in a village by the sea, there lived",
    " ".join(["The three primary colors are red, yellow and blue; mixing two of them gives "
              "a secondary color, and the painter knows"] * 4),  # past the 64-token budget
]
# The table's Qwen3-MoE: SmolLM2's vocabulary (49152, the tokenizer's); 8 experts of 32,
# top 2, normalized.
CONFIG = family("qwen3_moe").config


@pytest.fixture(scope="module")
def qwen3_moe(smollm2_tokenizer, tmp_path_factory):
    """(transformers model, our engine, warmed up), saved with SmolLM2's tokenizer."""
    config = transformers.Qwen3MoeConfig(**CONFIG, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from ones
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    hf.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(path)
    return hf, LLM(path, **ENGINE_ARGS)


def _hf_greedy(hf, ids, max_tokens: int = MAX_TOKENS):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                          min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _routed_experts(hf, ids) -> set[int]:
    """The experts transformers' first layer routes the prompt's tokens to."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    logits = out.router_logits[0].reshape(-1, CONFIG["num_experts"])
    return set(torch.topk(logits, CONFIG["num_experts_per_tok"]).indices.ravel().tolist())


@pytest.mark.slow  # the table's qwen3_moe row (module docstring); three buckets warmed up
def test_qwen3_moe_greedy_matches_transformers(qwen3_moe, smollm2_tokenizer):
    hf, llm = qwen3_moe
    assert llm.engine.model.cfg.num_experts == 8
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    assert len(ids[2]) > ENGINE_ARGS["max_num_batched_tokens"]  # chunked prefill
    # The prompts exercise the routing: several experts, not one.
    assert len(_routed_experts(hf, ids[0])) >= 4
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [_hf_greedy(hf, x) for x in ids]
    batched = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    alone = llm.generate([{"prompt_token_ids": ids[1]}], params, use_tqdm=False)
    for out, expected in zip(batched, want, strict=True):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 1  # not a degenerate repeat
        assert ours == expected, smollm2_tokenizer.decode(ours)
    assert alone[0].outputs[0].token_ids == want[1]
    # Warm-up compiled every program: no routing of these steps compiled another.
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


@pytest.mark.slow  # the table's warmed-up qwen3_moe row compiles nothing in its checks
def test_qwen3_moe_any_routing_compiles_nothing(qwen3_moe):
    """Random prompts (other routings, other batch mixes) after warm-up: no compiles."""
    _, llm = qwen3_moe
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 49152, n).tolist()} for n in (3, 17, 70)]
    params = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, seed=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0


@pytest.mark.slow  # the test above checks the tokens; this one the modes (swap: the table)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_qwen3_moe_greedy_under_preemption_prefix_hits_and_ngram(qwen3_moe, smollm2_tokenizer,
                                                                 mode):
    """The same tokens from a pool too small for the batch (requests preempted), a prompt
    sent twice (prefix-cache hits) and n-gram speculation verifying proposals."""
    hf, served = qwen3_moe
    llm = LLM(served.engine.model, tokenizer=smollm2_tokenizer,
              **{**ENGINE_ARGS, "warmup": False, "num_kv_blocks": 10,
                 "max_model_len": 128, "enable_prefix_caching": True,
                 "preemption_mode": mode, "swap_space": 0.05,
                 "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}})
    llm.engine.speculator.gate.min_acceptance = 0.0  # proposals every step
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    ids.append(list(ids[2]))  # a prefix hit once the first copy's pages are cached
    # NOTE: longer outputs: the random model's text repeats itself, so proposals hold.
    params = SamplingParams(temperature=0.0, max_tokens=3 * MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt_ids, 3 * MAX_TOKENS)
    metrics = llm.get_metrics()
    assert metrics["jaxserve:num_preemptions"] > 0
    assert metrics["jaxserve:prefix_cache_hits"] > 0
    assert metrics["jaxserve:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow  # another engine's programs; the tokens are checked above
def test_qwen3_moe_under_tensor_parallelism(qwen3_moe, smollm2_tokenizer):
    """Tensor parallelism 2 (attention split by heads, each routed expert's width split:
    `models.moe_parallel`) gives transformers' tokens."""
    hf, served = qwen3_moe
    llm = LLM(served.engine.model, tokenizer=smollm2_tokenizer,
              **{**ENGINE_ARGS, "warmup": False, "tensor_parallel_size": 2})
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt_ids)


# Slow tier: a second engine's compiles (~25 s here); the default tier checks int8 experts
# at the model level (tests/models/test_moe_loading.py, test_moe_quant.py: the serving form).
@pytest.mark.slow
def test_qwen3_moe_int8_greedy_is_its_dequantized_model(qwen3_moe, smollm2_tokenizer):
    """int8 weights, the routed expert stacks included (q8 leaves [L, E, ...] in the
    serving form), served greedily: every token is the argmax of the float model holding
    the dequantized weights (teacher-forced over prompt + output), batched; and the same
    tokens under tensor parallelism 2 (the quantized experts split on their width)."""
    from models.linear import STACKS, standard_params
    from models.model import Model
    from tests.models.helpers import dequantized_params, forward_logits

    _, served = qwen3_moe
    llm = LLM(served.engine.model.source, quantization="int8",
              **{**ENGINE_ARGS, "warmup": False})
    model = llm.engine.model
    assert "qweight" in model.params[STACKS]["layers"]["mlp"]["experts"]["gate_proj"]
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    floats = Model(model.cfg, dequantized_params(standard_params(model.params, model.cfg)),
                   serving=ServingChoice("xla"))
    for prompt_ids, out in zip(ids, outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert len(set(tokens)) > 1
        logits = forward_logits(floats, prompt_ids + tokens[:-1])
        assert logits[len(prompt_ids) - 1:].argmax(-1).tolist() == tokens
    tp = LLM(model, tokenizer=smollm2_tokenizer,
             **{**ENGINE_ARGS, "warmup": False, "tensor_parallel_size": 2})
    codes = standard_params(tp.engine.runner.params, model.cfg)["layers"]["mlp"]["experts"][
        "up_proj"]
    sharding = codes["qweight"].sharding
    assert codes["qweight"].dtype == np.int8
    assert len(sharding.device_set) == 2 and not sharding.is_fully_replicated
    assert sharding.spec[-1] == ("kv", "rep")  # up's [L, E, H, I]: I split
    tp_outs = tp.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tp_outs] == [o.outputs[0].token_ids for o in outs]

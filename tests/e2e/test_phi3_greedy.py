"""Greedy generation of a tiny random Phi-3 through the engine equals transformers'
`generate`: fused qkv/gate_up weights split at load, LongRoPE past the original context
with a partial rotary, and a sliding window shorter than the prompts."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The shared tiny-engine sizes; only the buckets these prompts use are compiled.
ENGINE_ARGS = {**TINY_ENGINE, "warmup": False}
MAX_TOKENS = 12
ORIGINAL = 8  # the original context: every prompt is longer
PROMPTS = [
    "Paged attention stores the key and value cache in fixed-size blocks, and the "
    "scheduler decides which requests advance",
    "Once upon a time, in a village by the sea, there lived",
    "The three primary colors are red, yellow and blue; mixing two of them gives",
]
# SmolLM2's vocabulary (49152, the tokenizer's); hidden 64, heads of 16 with half of each
# rotated (Phi-4-mini's partial rotary), a window of 8, an untied LM head.
CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.5,
              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5,
                               "short_factor": [1.0, 1.2, 1.9, 3.0],
                               "long_factor": [1.3, 3.5, 8.0, 24.0]},
              initializer_range=0.1, sliding_window=8, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def phi3(smollm2_tokenizer, tmp_path_factory):
    """(transformers model, our engine), saved with SmolLM2's tokenizer."""
    config = transformers.Phi3Config(**CONFIG, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from ones
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    path = str(tmp_path_factory.mktemp("phi3"))
    hf.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(path)
    hf.local_path = path
    return hf, LLM(path, **ENGINE_ARGS)


def _hf_greedy(hf, ids):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          min_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_phi3_greedy_matches_transformers(phi3, smollm2_tokenizer):
    """transformers takes LongRoPE's long factors once a sequence passes the original
    context (its generate recomputes the cache there); every prompt here starts past it,
    so both run the long factors throughout, the engine's for its max_model_len (256)."""
    hf, llm = phi3
    cfg = llm.engine.model.cfg
    assert cfg.rope_scaling.use_long_factors and cfg.rotary_dim == 8
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    assert min(len(x) for x in ids) > max(ORIGINAL, CONFIG["sliding_window"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    for prompt_ids, out in zip(ids, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 1  # not a degenerate repeat
        assert ours == _hf_greedy(hf, prompt_ids), smollm2_tokenizer.decode(ours)


def test_a_short_max_model_len_serves_the_short_factors(phi3, smollm2_tokenizer):
    """An engine whose contexts never pass the original length runs LongRoPE's short
    factors, as transformers does for such sequences."""
    hf, _ = phi3
    llm = LLM(hf.local_path, **{**ENGINE_ARGS, "max_model_len": ORIGINAL})
    assert not llm.engine.model.cfg.rope_scaling.use_long_factors
    ids = smollm2_tokenizer("Once upon a").input_ids[:4]
    params = SamplingParams(temperature=0.0, max_tokens=ORIGINAL - len(ids), ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=ORIGINAL - len(ids),
                           do_sample=False, min_new_tokens=ORIGINAL - len(ids),
                           pad_token_id=0)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == want

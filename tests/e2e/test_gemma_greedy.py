"""Greedy generation of tiny random Gemma 2 and Gemma 3 models through the engine equals
transformers' `generate` (sliding windows shorter than the prompts, soft caps that bind)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The shared tiny-engine sizes; only the buckets these prompts use are compiled.
ENGINE_ARGS = {**TINY_ENGINE, "warmup": False}
MAX_TOKENS = 12
PROMPTS = [
    "Paged attention stores the key and value cache in fixed-size blocks, and the "
    "scheduler decides which requests advance",
    "Once upon a time",
    "The three primary colors are red, yellow and blue; mixing two of them gives",
]

# SmolLM2's vocabulary (49152, the tokenizer's); hidden 64, heads of 16, windows of 8; an
# untied LM head (a tied random one repeats one token).
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            initializer_range=0.1, sliding_window=8, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=2, query_pre_attn_scalar=32,
                    attn_logit_softcapping=2.0, final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, query_pre_attn_scalar=16, sliding_window_pattern=3,
                    final_logit_softcapping=4.0,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 10000.0},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 100.0}})),
}


# The shared sizes' "xla" backend; the "cpu" backend (the C++ decode kernel with the soft
# cap, packed weights) in the slow tier, as the `cpu` backend's other engine runs.
@pytest.fixture(scope="module", params=[
    *FAMILIES, *(pytest.param(f"{f}-cpu", marks=pytest.mark.slow) for f in FAMILIES)])
def gemma(request, smollm2_tokenizer, tmp_path_factory):
    """(transformers model, our engine) of one tiny family, saved with SmolLM2's tokenizer."""
    family, _, backend = request.param.partition("-")
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**BASE, **extra, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from their zero init: (1 + weight) must matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    path = str(tmp_path_factory.mktemp(family))
    hf.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(path)
    if backend == "cpu":
        from pallas_kernels import cpu_ffi

        if not cpu_ffi.available():
            pytest.skip(f"no CPU kernel here: {cpu_ffi.unavailable_reason()}")
    llm = LLM(path, **{**ENGINE_ARGS, "attention_backend": backend or "xla"})
    assert llm.engine.model.backend == (backend or "xla")
    return hf, llm


def _hf_greedy(hf, ids):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          min_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_gemma_greedy_matches_transformers(gemma, smollm2_tokenizer):
    hf, llm = gemma
    ids = [smollm2_tokenizer(p).input_ids for p in PROMPTS]
    assert len(ids[0]) > 2 * BASE["sliding_window"]  # the window binds
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    for prompt_ids, out in zip(ids, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 1  # not a degenerate repeat
        assert ours == _hf_greedy(hf, prompt_ids), smollm2_tokenizer.decode(ours)

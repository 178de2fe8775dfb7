"""Greedy generation of SmolLM2 through the engine (as `jaxserve generate` runs it) equals
transformers' generate."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams

PROMPTS = [
    "Once upon a time",
    "The three primary colors are",
    "def fibonacci(n):",
    "Paris is the capital of France. Berlin is the capital of",
    "1, 2, 3, 4, 5,",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm(smollm2, smollm2_tokenizer):
    # A page size of 8 puts 32-token continuations across several pages; one request at
    # a time, as `jaxserve generate` runs it. NOTE: 8 sequences, as the serving tests' engine:
    # the sampler programs (8 rows) come from the compilation cache.
    return LLM(smollm2, tokenizer=smollm2_tokenizer, block_size=8, max_model_len=256,
               max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64, warmup=False)


def _chat_ids(tokenizer):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three fruits."}], add_generation_prompt=True,
        tokenize=True, return_dict=False)


def _hf_greedy(hf_model, ids, eos):
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


# NOTE: three prompts (prose, code, the chat template) in the default tier; the other three
# run the same comparison in the slow tier (each costs a 32-token transformers generate).
SLOW_PROMPTS = ("The three primary colors are",
                "Paris is the capital of France. Berlin is the capital of", "1, 2, 3, 4, 5,")


@pytest.mark.parametrize("prompt", [
    pytest.param(p, marks=[pytest.mark.slow] if p in SLOW_PROMPTS else [])
    for p in PROMPTS + ["<chat>"]])
def test_greedy_matches_transformers(llm, hf_smollm2, smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    ids = _chat_ids(tok) if prompt == "<chat>" else tok(prompt).input_ids
    eos = tok.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    ours = out.token_ids
    assert ours == _hf_greedy(hf_smollm2, ids, eos), tok.decode(ours)


def test_bad_requests_raise(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([{"prompt_token_ids": []}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"ids outside \[0, 49152\)"):
        llm.generate([{"prompt_token_ids": [1, 49152]}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([{"prompt_token_ids": [1] * 300}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

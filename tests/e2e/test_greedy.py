"""Greedy generation of SmolLM2 through the paged cache equals transformers' generate."""

from __future__ import annotations

import pytest

from jaxserve.engine.greedy import GreedyGenerator, prefill_bucket

PROMPTS = [
    "Once upon a time",
    "The three primary colors are",
    "def fibonacci(n):",
    "Paris is the capital of France. Berlin is the capital of",
    "1, 2, 3, 4, 5,",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def generator(smollm2):
    # A page size of 8 puts 32-token continuations across several pages.
    return GreedyGenerator(smollm2, page_size=8)


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


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS + ["<chat>"])
def test_greedy_matches_transformers(generator, hf_smollm2, smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    ids = _chat_ids(tok) if prompt == "<chat>" else tok(prompt).input_ids
    eos = tok.eos_token_id
    ours = generator.generate(ids, MAX_TOKENS, stop_token_ids=[eos])
    assert ours == _hf_greedy(hf_smollm2, ids, eos), tok.decode(ours)


def test_bad_requests_raise(generator):
    with pytest.raises(ValueError, match="prompt is empty"):
        generator.generate([], 4)
    with pytest.raises(ValueError, match="max_tokens must be positive"):
        generator.generate([1, 2], 0)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 49152\)"):
        generator.generate([1, 49152], 4)
    with pytest.raises(ValueError, match="exceeds max_model_len 2048"):
        generator.generate([1] * 2000, 100)


def test_prefill_bucket():
    assert [prefill_bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
    assert prefill_bucket(3, minimum=4) == 4

"""Prompt logprobs equal transformers' log-softmax at every prompt position, across chunks."""

from __future__ import annotations

import numpy as np

from jaxserve import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog because it was"


def test_prompt_logprobs_match_transformers(smollm2, smollm2_tokenizer, hf_smollm2):
    import torch

    # A 16-token budget cuts the prompt into chunks; the second request shares its prefix.
    # NOTE: otherwise the serving tests' sizes (tests/entrypoints/conftest.py), so its
    # 16-token bucket's programs are the server's, from the compilation cache.
    llm = LLM(smollm2, tokenizer=smollm2_tokenizer, max_num_seqs=8, max_num_batched_tokens=16,
              max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    first, second = llm.generate([PROMPT, PROMPT + " tired"], params, use_tqdm=False)
    for out in (first, second):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0], -1).numpy()
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        for pos in range(1, len(ids)):
            entry = lps[pos]
            assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]]) < 1e-3
            top = np.argsort(-ref[pos - 1])[:3]
            ranked = sorted((lp.rank, t) for t, lp in entry.items() if t != ids[pos]
                            or lp.rank <= 3)
            assert [t for r, t in ranked if r <= 3][:3] == list(top)
        # Every prompt position was computed, none served from the prefix cache.
        assert out.num_cached_tokens == 0
    assert first.outputs[0].token_ids == llm.generate([PROMPT], SamplingParams(
        max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.get_metrics()["jaxserve:num_compilations"] == 0

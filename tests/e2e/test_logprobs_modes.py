"""`max_logprobs`, `logprobs=-1` / `prompt_logprobs=-1` and `logprobs_mode` on the tiny model.

The oracles: transformers' logits of the same tiny model, and a sampler written in NumPy
(`tests/sample/reference_sampler.py`: penalties, temperature, min-p, top-k, top-p) whose
log-distribution the engine's "processed_logprobs" must equal, over the whole vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.sample.reference_sampler import log_softmax, processed_logprobs

# NOTE: a 16-token budget (few buckets to warm up) and no prefix caching, so every prompt
# position is computed (prompt logprobs) whatever ran before.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128, num_kv_blocks=40,
              attention_backend="xla", enable_prefix_caching=False)
VOCAB = 49152
PROMPTS = ["The capital of France is", "Once upon a time there", "1, 2, 3, 4,", "def f(x):"]


@pytest.fixture(scope="module")
def processed(tiny_model_dir) -> LLM:
    """One engine serving every check of a non-default mode: processed logprobs, the whole
    vocabulary allowed (max_logprobs=-1: warm-up compiles the wide width too)."""
    return LLM(tiny_model_dir, logprobs_mode="processed_logprobs", max_logprobs=-1, **ENGINE)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # NOTE: as conftest's hf_smollm2: XLA shares the 2 cores
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def logits(ids: list[int]) -> np.ndarray:
        """f64[len(ids), V] the model's logits after each prefix of `ids`."""
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().numpy()

    return logits


def dense(entry: dict) -> np.ndarray:
    """f64[V] from a whole-vocabulary logprobs entry ({token: Logprob})."""
    assert len(entry) == VOCAB
    out = np.full(VOCAB, np.nan)
    for token, lp in entry.items():
        out[token] = lp.logprob
    return out


def test_processed_logprobs_are_the_sampling_distribution(processed, hf_tiny):
    """Every step's whole-vocabulary logprobs (logprobs=-1) equal the log of the NumPy
    sampler's distribution over transformers' logits, the dropped ids exactly; greedy and
    random rows share the steps."""
    params = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=1),
        SamplingParams(temperature=1.3, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3, seed=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5),
        SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1, top_k=100, seed=3),
    ]
    params = [p.clone(max_tokens=4, logprobs=-1, detokenize=False) for p in params]
    outs = processed.generate(PROMPTS, params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        prompt, comp = out.prompt_token_ids, out.outputs[0]
        logits = hf_tiny(prompt + comp.token_ids[:-1])[len(prompt) - 1:]
        assert len(comp.logprobs) == len(comp.token_ids) == 4
        for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            got = dense(entry)
            ref = processed_logprobs(logits[i], prompt, comp.token_ids[:i], p)
            np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
            kept = np.isfinite(ref)
            np.testing.assert_allclose(got[kept], ref[kept], atol=2e-3)
            assert np.isfinite(got[token]) and entry[token].rank >= 1
        if p.top_k:  # the filters dropped nearly everything
            assert np.isfinite(got).sum() <= p.top_k
    assert processed.get_metrics()["jaxserve:num_compilations"] == 0


def test_whole_vocabulary_prompt_logprobs_are_raw(processed, hf_tiny):
    """prompt_logprobs=-1 returns every token at every position: transformers' log-softmax
    (raw in every mode, as vLLM's), ranked; a sample request of max_logprobs' size too."""
    (out,) = processed.generate([PROMPTS[0]], SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=-1, logprobs=VOCAB, detokenize=False),
        use_tqdm=False)
    ids = out.prompt_token_ids
    ref = hf_tiny(ids)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        got = dense(out.prompt_logprobs[pos])
        want = log_softmax(ref[pos - 1])
        np.testing.assert_allclose(got, want, atol=2e-3)
        ranks = sorted(out.prompt_logprobs[pos].items(), key=lambda kv: kv[1].rank)
        assert [t for t, _ in ranks[:5]] == list(np.argsort(-want)[:5])
    assert len(out.outputs[0].logprobs[0]) == VOCAB
    assert processed.get_metrics()["jaxserve:num_compilations"] == 0


def test_more_than_the_vocabulary_is_refused(processed):
    """max_logprobs=-1 allows up to the vocabulary, with vLLM's message above it."""
    for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        with pytest.raises(ValueError, match=f"^Requested {kind} logprobs of {VOCAB + 1}, "
                                             f"which is greater than max allowed: {VOCAB}$"):
            processed.generate(["hi"], SamplingParams(**{field: VOCAB + 1}), use_tqdm=False)


def test_raw_logits_mode_returns_transformers_logits(tiny_model_dir, hf_tiny):
    """"raw_logits": the sampled token's value and the top alternatives are the model's
    logits (transformers'), before the penalty and temperature that changed the draw."""
    llm = LLM(tiny_model_dir, logprobs_mode="raw_logits", warmup=False, **ENGINE)
    (out,) = llm.generate([PROMPTS[1]], SamplingParams(
        max_tokens=3, temperature=0.7, seed=5, presence_penalty=1.0, logprobs=5,
        detokenize=False), use_tqdm=False)
    prompt, comp = out.prompt_token_ids, out.outputs[0]
    logits = hf_tiny(prompt + comp.token_ids[:-1])[len(prompt) - 1:]
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        assert entry[token].logprob == pytest.approx(logits[i, token], abs=2e-3)
        assert entry[token].rank == int((logits[i] >= logits[i, token] - 1e-6).sum())
        top = [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= 5]
        assert top == list(np.argsort(-logits[i])[:5])
        for t in top:
            assert entry[t].logprob == pytest.approx(logits[i, t], abs=2e-3)

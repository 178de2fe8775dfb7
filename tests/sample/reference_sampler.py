"""A sampler's processed distribution in NumPy, written from the documented rules (vLLM,
OpenAI, transformers), as the oracle of the "processed" logprobs modes."""

from __future__ import annotations

import numpy as np

from jaxserve.sampling_params import SamplingParams


def log_softmax(x: np.ndarray) -> np.ndarray:
    """f64 log-softmax of a vector whose -inf entries stay -inf."""
    finite = x[np.isfinite(x)]
    top = finite.max()
    return x - (top + np.log(np.exp(finite - top).sum()))


def processed_logits(logits: np.ndarray, prompt, output, p: SamplingParams) -> np.ndarray:
    """f64[V]: the logits a request's next token is drawn from.

    Repetition penalty over the prompt and output tokens (positive logits divided, negative
    multiplied), then `frequency * count + presence * (count > 0)` subtracted over output
    counts; a greedy request (temperature 0) stops there. Else divided by the temperature;
    min-p drops tokens whose probability is below min_p times the largest; top-k keeps the
    k largest (ties kept); top-p keeps the smallest set of most likely tokens whose
    probability (renormalised after top-k) reaches p. Dropped tokens are -inf.
    """
    x = np.asarray(logits, np.float64).copy()
    seen = np.zeros(len(x), bool)
    seen[list(prompt) + list(output)] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty,
                       x[seen] * p.repetition_penalty)
    counts = np.bincount(np.asarray(list(output), np.int64), minlength=len(x))
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.temperature < 1e-5:
        return x
    x /= p.temperature
    probs = np.exp(log_softmax(x))
    x[probs < p.min_p * probs.max()] = -np.inf
    if p.top_k > 0:
        x[x < np.sort(x)[-p.top_k]] = -np.inf
    if p.top_p < 1.0:
        probs = np.exp(log_softmax(x))
        order = np.argsort(-probs, kind="stable")
        keep = int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1
        x[order[keep:]] = -np.inf
    return x


def processed_logprobs(logits: np.ndarray, prompt, output, p: SamplingParams) -> np.ndarray:
    """f64[V]: the log of the distribution a request's next token is drawn from."""
    return log_softmax(processed_logits(logits, prompt, output, p))

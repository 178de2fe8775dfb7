"""Synthetic request traces: length distributions, arrival processes, JSONL save and load.

A trace is a list of `TraceRequest`s (prompt length, output length, arrival time, an
optional shared-prefix id), seeded so runs are comparable, and saved as JSONL so the same
trace can feed the engine, the server benchmark and the scheduler simulator.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        prompt_len: Prompt tokens.
        output_len: Tokens to generate (the request ignores EOS).
        arrival_time: Seconds after the start of the run.
        prefix_id: Requests with the same id share their first `prefix_len` tokens.
        prefix_len: Length of that shared prefix (0: none).
        prompt_ids: The prompt's token ids when the trace has real text (the copying
            trace); None: `trace_token_ids` draws random ids.
    """

    prompt_len: int
    output_len: int
    arrival_time: float = 0.0
    prefix_id: int | None = None
    prefix_len: int = 0
    prompt_ids: tuple[int, ...] | None = None


def sample_lengths(rng: np.random.Generator, dist: str, n: int, mean: float, spread: float,
                   low: int = 1, high: int | None = None) -> np.ndarray:
    """i64[n] lengths from "fixed", "uniform" (mean +- spread) or "lognormal" (sd spread).

    Raises:
        ValueError: Unknown distribution or non-positive mean.
    """
    if mean <= 0:
        raise ValueError(f"mean length must be positive, got {mean}")
    if dist == "fixed":
        x = np.full(n, mean)
    elif dist == "uniform":
        x = rng.uniform(mean - spread, mean + spread, n)
    elif dist == "lognormal":
        sigma2 = np.log1p((spread / mean) ** 2) if spread > 0 else 0.0
        x = rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2), n)
    elif dist == "normal":
        x = rng.normal(mean, spread, n)
    else:
        raise ValueError(f"unknown length distribution {dist!r}; choose fixed, uniform, "
                         "lognormal or normal")
    return np.clip(np.rint(x), low, high if high is not None else None).astype(np.int64)


def arrivals(rng: np.random.Generator, n: int, rate: float | None) -> np.ndarray:
    """f64[n] arrival times: all at 0 (rate None or inf) or a Poisson process at `rate`/s."""
    if rate is None or np.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, n))


def synthetic_trace(n: int, *, prompt_dist: str = "uniform", prompt_mean: float = 128,
                    prompt_spread: float = 64, output_dist: str = "uniform",
                    output_mean: float = 64, output_spread: float = 32,
                    rate: float | None = None, max_model_len: int | None = None,
                    seed: int = 0) -> list[TraceRequest]:
    """A trace with independent prompt and output lengths."""
    rng = np.random.default_rng(seed)
    prompts = sample_lengths(rng, prompt_dist, n, prompt_mean, prompt_spread)
    outputs = sample_lengths(rng, output_dist, n, output_mean, output_spread)
    if max_model_len is not None:
        prompts = np.minimum(prompts, max_model_len - 1)
        outputs = np.minimum(outputs, max_model_len - prompts)
    times = arrivals(rng, n, rate)
    return [TraceRequest(int(p), int(o), float(t)) for p, o, t in zip(prompts, outputs, times,
                                                                      strict=True)]


def mixed_trace(n: int = 32, *, long_fraction: float = 0.25, short_prompt: int = 32,
                long_prompt: int = 512, short_output: int = 64, long_output: int = 32,
                rate: float | None = None, seed: int = 0) -> list[TraceRequest]:
    """A mixed serving workload: many short chats and a few long-document prompts.

    Long prompts are what freezes decodes without chunked prefill; short ones with longer
    outputs are what static batching pads and waits on.
    """
    rng = np.random.default_rng(seed)
    is_long = rng.random(n) < long_fraction
    prompts = np.where(is_long, sample_lengths(rng, "uniform", n, long_prompt, long_prompt / 4),
                       sample_lengths(rng, "uniform", n, short_prompt, short_prompt / 2))
    outputs = np.where(is_long, sample_lengths(rng, "uniform", n, long_output, long_output / 2),
                       sample_lengths(rng, "uniform", n, short_output, short_output / 2))
    times = arrivals(rng, n, rate)
    return [TraceRequest(int(p), int(o), float(t)) for p, o, t in zip(prompts, outputs, times,
                                                                      strict=True)]


def shared_prefix_trace(n: int = 32, *, prefix_len: int = 256, suffix_mean: float = 32,
                        output_mean: float = 32, num_prefixes: int = 1,
                        rate: float | None = None, seed: int = 0) -> list[TraceRequest]:
    """Requests that share a system prompt (for prefix caching)."""
    rng = np.random.default_rng(seed)
    suffix = sample_lengths(rng, "uniform", n, suffix_mean, suffix_mean / 2)
    outputs = sample_lengths(rng, "uniform", n, output_mean, output_mean / 2)
    times = arrivals(rng, n, rate)
    return [TraceRequest(prefix_len + int(s), int(o), float(t), prefix_id=i % num_prefixes,
                         prefix_len=prefix_len)
            for i, (s, o, t) in enumerate(zip(suffix, outputs, times, strict=True))]


def trace_token_ids(trace: list[TraceRequest], vocab_size: int, seed: int = 0,
                    avoid: tuple[int, ...] = ()) -> list[list[int]]:
    """Concrete prompt token ids for a trace (shared prefixes identical), seeded.

    Args:
        avoid: Ids never used (e.g. special tokens), so prompts stay ordinary text ids.
    """
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(min(vocab_size, 32000)), np.asarray(avoid, np.int64))
    prefixes: dict[int, np.ndarray] = {}
    out = []
    for r in trace:
        if r.prompt_ids is not None:
            out.append(list(r.prompt_ids))
            continue
        ids = rng.choice(allowed, r.prompt_len)
        if r.prefix_id is not None and r.prefix_len:
            if r.prefix_id not in prefixes:
                prefixes[r.prefix_id] = rng.choice(allowed, r.prefix_len)
            ids[:r.prefix_len] = prefixes[r.prefix_id]
        out.append([int(t) for t in ids])
    return out


def save_trace(path: str, trace: list[TraceRequest]) -> None:
    """Writes one JSON object per request."""
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps(asdict(r)) + "\n")


def load_trace(path: str) -> list[TraceRequest]:
    """Reads what `save_trace` wrote.

    Raises:
        ValueError: A line is not a trace request (the message gives the line number).
    """
    out = []
    with open(path) as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
                if fields.get("prompt_ids") is not None:
                    fields["prompt_ids"] = tuple(fields["prompt_ids"])
                out.append(TraceRequest(**fields))
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not a trace request ({e})") from None
    return out

"""Latency and throughput summaries in the fields `vllm bench serve` prints.

TTFT: arrival to first token. TPOT: (e2e - TTFT) / (output tokens - 1). ITL: each gap
between consecutive tokens of a request. E2EL: arrival to last token. All reported as
mean, median and P99 in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTiming:
    """Observed times of one request (seconds, one clock).

    Attributes:
        arrival: When it was submitted.
        token_times: When each output token became visible (first = TTFT point).
        prompt_len: Prompt tokens.
        num_tokens: Output tokens when a time stamps several (a streamed chunk holding
            more than one token); None: one token per time.
    """

    arrival: float
    prompt_len: int
    token_times: list[float] = field(default_factory=list)
    num_tokens: int | None = None

    @property
    def output_len(self) -> int:
        return self.num_tokens if self.num_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def _describe(name: str, values_s: list[float]) -> dict[str, float]:
    x = np.asarray(values_s, np.float64) * 1000.0
    if x.size == 0:
        return {f"mean_{name}_ms": float("nan"), f"median_{name}_ms": float("nan"),
                f"p99_{name}_ms": float("nan")}
    return {f"mean_{name}_ms": float(x.mean()), f"median_{name}_ms": float(np.median(x)),
            f"p99_{name}_ms": float(np.percentile(x, 99))}


def summarize(timings: list[RequestTiming], duration_s: float,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              slo_e2el_ms: float | None = None) -> dict:
    """Throughput and latency figures of a finished run.

    Args:
        timings: Every completed request.
        duration_s: Wall (or simulated) time of the run.
        slo_ttft_ms: TTFT bound for goodput (None: not checked).
        slo_tpot_ms: TPOT bound for goodput (None: not checked).
        slo_e2el_ms: End-to-end latency bound for goodput (None: not checked).

    Returns:
        A flat dict: completed, duration, request/output/total token throughput, goodput,
        and mean/median/p99 of ttft, tpot, itl and e2el in ms.
    """
    done = [t for t in timings if t.output_len > 0 and t.token_times]
    out_tokens = sum(t.output_len for t in done)
    in_tokens = sum(t.prompt_len for t in done)
    good = [t for t in done
            if (slo_ttft_ms is None or t.ttft * 1000 <= slo_ttft_ms)
            and (slo_tpot_ms is None or (t.tpot or 0.0) * 1000 <= slo_tpot_ms)
            and (slo_e2el_ms is None or t.e2e * 1000 <= slo_e2el_ms)]
    res = {
        "completed": len(done),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
        "request_goodput": len(good) / duration_s if duration_s else 0.0,
    }
    res.update(_describe("ttft", [t.ttft for t in done]))
    res.update(_describe("tpot", [t.tpot for t in done if t.tpot is not None]))
    res.update(_describe("itl", [g for t in done for g in t.itls]))
    res.update(_describe("e2el", [t.e2e for t in done]))
    return res

"""Scheduler simulator: the real Scheduler and KVCacheManager driven by a step-cost model.

No model runs: each step's duration comes from a cost model of its token count, request
count and the KV it reads, so policies can be studied at scale (thousands of requests,
accelerator-like step times) in seconds, reporting the same fields as a real run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxserve.bench.stats import RequestTiming, summarize
from jaxserve.bench.workloads import TraceRequest, trace_token_ids
from jaxserve.config import SchedulerConfig
from jaxserve.core.baseline_schedulers import scheduler_class
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class CostModel:
    """Step time = fixed + per token + per request + per KV token read (attention).

    Attributes:
        fixed_ms: Per step (weights read once per step, launch overheads).
        per_token_ms: Per scheduled token (matmul FLOPs).
        per_seq_ms: Per scheduled request (sampling, bookkeeping).
        per_kv_token_us: Per context token attended (KV bytes read).
    """

    fixed_ms: float
    per_token_ms: float
    per_seq_ms: float = 0.0
    per_kv_token_us: float = 0.0

    def step_seconds(self, num_tokens: int, num_seqs: int, num_kv_tokens: int) -> float:
        return (self.fixed_ms + self.per_token_ms * num_tokens + self.per_seq_ms * num_seqs
                + self.per_kv_token_us * num_kv_tokens / 1000.0) / 1000.0


# NOTE: "gpu-8b" is illustrative (an 8B model on one modern GPU: ~8 ms weight-bound decode
# step, compute-bound prefill near 10k tokens/s); "cpu-smollm2" is fitted to this project's
# CPU runs of SmolLM2-135M (see BENCHMARKS.md).
PRESETS = {
    "gpu-8b": CostModel(fixed_ms=8.0, per_token_ms=0.1, per_seq_ms=0.01,
                        per_kv_token_us=0.02),
    "cpu-smollm2": CostModel(fixed_ms=30.0, per_token_ms=2.5, per_seq_ms=0.3,
                             per_kv_token_us=0.5),
}


@dataclass
class SimResult:
    """Summary figures plus a per-step timeline (time, running, waiting, KV usage, tokens)."""

    summary: dict
    timeline: list[tuple[float, int, int, float, int]] = field(default_factory=list)


class _Arrivals:
    """The trace's requests in arrival order, handed to the scheduler as the clock passes."""

    def __init__(self, trace: list[TraceRequest], seed: int):
        self.trace = trace
        self.token_ids = trace_token_ids(trace, 32000, seed=seed)
        self.order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_time)
        self.next = 0

    @property
    def pending(self) -> bool:
        """Whether requests are still to arrive."""
        return self.next < len(self.order)

    @property
    def next_time(self) -> float:
        """When the next request arrives."""
        return self.trace[self.order[self.next]].arrival_time

    def admit(self, sched: Scheduler, clock: float, timings: dict[str, RequestTiming]) -> None:
        """Adds every request that has arrived by `clock` and starts its timing record."""
        while self.pending and self.next_time <= clock:
            i = self.order[self.next]
            r = self.trace[i]
            req = Request(f"sim-{i}", self.token_ids[i], arrival_time=r.arrival_time,
                          sampling_params=SamplingParams(max_tokens=r.output_len,
                                                         ignore_eos=True, temperature=0.0))
            sched.add_request(req)
            timings[req.request_id] = RequestTiming(r.arrival_time, r.prompt_len)
            self.next += 1


@dataclass
class _Totals:
    """Running totals over the simulated steps."""

    clock: float = 0.0  # simulated seconds
    busy: float = 0.0  # simulated seconds spent in steps
    host: float = 0.0  # real seconds spent in schedule + update
    steps: int = 0
    batch: int = 0  # scheduled requests, summed over steps


def simulate(trace: list[TraceRequest], cost: CostModel, scheduler: SchedulerConfig, *,
             num_pages: int, page_size: int = 16, max_model_len: int = 2048,
             max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
             swap_space_pages: int = 0, seed: int = 0) -> SimResult:
    """Runs `trace` through the real scheduler on a simulated clock.

    Returns:
        The same summary fields as `jaxserve.bench.stats.summarize`, plus preemptions,
        prefix hit rate, step count, mean batch size, and host milliseconds per step
        spent in the scheduler (schedule + update).
    """
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=enable_prefix_caching,
                        swap_space=float(swap_space_pages), bytes_per_page=2**30,
                        max_model_len=max_model_len)
    sched = scheduler_class(scheduler.scheduling_mode)(scheduler, kv, max_model_len,
                                                       max_num_batched_tokens)
    arrivals = _Arrivals(trace, seed)
    timings: dict[str, RequestTiming] = {}
    totals = _Totals()
    result = SimResult({})
    while arrivals.pending or sched.has_unfinished_requests():
        arrivals.admit(sched, totals.clock, timings)
        t0 = time.perf_counter()
        out = sched.schedule()
        totals.host += time.perf_counter() - t0
        if out.is_empty:
            if not arrivals.pending:
                break  # nothing can run and nothing will arrive
            totals.clock = max(totals.clock, arrivals.next_time)
            continue
        _run_step(sched, out, cost, totals, timings)
        result.timeline.append((totals.clock, len(sched.running), len(sched.waiting), kv.usage,
                                out.total_num_scheduled_tokens))
    result.summary = _summary(timings, totals, result.timeline, sched, kv)
    return result


def _run_step(sched: Scheduler, out: SchedulerOutput, cost: CostModel, totals: _Totals,
              timings: dict[str, RequestTiming]) -> None:
    """Advances the clock by the step's modelled time and feeds back one token per sample."""
    kv_tokens = sum(s.start_pos + s.num_new_tokens for s in out.scheduled)
    dt = cost.step_seconds(out.total_num_scheduled_tokens, len(out.scheduled), kv_tokens)
    totals.clock += dt
    totals.busy += dt
    sampled = {s.request_id: [1] * s.num_samples for s in out.scheduled if s.num_samples}
    t0 = time.perf_counter()
    for req, tokens in sched.update_from_output(out, sampled):
        timings[req.request_id].token_times.extend([totals.clock] * len(tokens))
    totals.host += time.perf_counter() - t0
    totals.steps += 1
    totals.batch += len(out.scheduled)


def _summary(timings: dict[str, RequestTiming], totals: _Totals, timeline: list[tuple],
             sched: Scheduler, kv: KVCacheManager) -> dict:
    """`summarize`'s fields plus the simulator's step and scheduler figures."""
    summary = summarize(list(timings.values()), totals.clock)
    steps = totals.steps
    summary.update({
        "num_steps": steps, "mean_batch_size": totals.batch / steps if steps else 0.0,
        "mean_tokens_per_step": sum(x[4] for x in timeline) / steps if steps else 0.0,
        "mean_step_ms": 1000 * totals.busy / steps if steps else 0.0,
        "max_kv_usage": max((x[3] for x in timeline), default=0.0),
        "max_num_waiting": max((x[2] for x in timeline), default=0),
        "num_preemptions": sched.num_preemptions,
        "prefix_cache_hit_rate": kv.stats().prefix_hit_rate,
        "host_ms_per_step": 1000 * totals.host / steps if steps else 0.0,
    })
    return summary

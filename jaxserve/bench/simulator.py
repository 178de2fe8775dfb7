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
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
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
    sched = Scheduler(scheduler, kv, max_model_len, max_num_batched_tokens)
    ids = trace_token_ids(trace, 32000, seed=seed)
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_time)
    timings: dict[str, RequestTiming] = {}
    clock, next_arrival, steps, host, batch, busy = 0.0, 0, 0, 0.0, 0, 0.0
    result = SimResult({})
    while next_arrival < len(order) or sched.has_unfinished_requests():
        while next_arrival < len(order) and trace[order[next_arrival]].arrival_time <= clock:
            i = order[next_arrival]
            r = trace[i]
            req = Request(f"sim-{i}", ids[i], arrival_time=r.arrival_time,
                          sampling_params=SamplingParams(max_tokens=r.output_len,
                                                         ignore_eos=True, temperature=0.0))
            sched.add_request(req)
            timings[req.request_id] = RequestTiming(r.arrival_time, r.prompt_len)
            next_arrival += 1
        t0 = time.perf_counter()
        out = sched.schedule()
        host += time.perf_counter() - t0
        if out.is_empty:
            if next_arrival >= len(order):
                break  # nothing can run and nothing will arrive
            clock = max(clock, trace[order[next_arrival]].arrival_time)
            continue
        kv_tokens = sum(s.start_pos + s.num_new_tokens for s in out.scheduled)
        dt = cost.step_seconds(out.total_num_scheduled_tokens, len(out.scheduled), kv_tokens)
        clock += dt
        busy += dt
        sampled = {s.request_id: [1] * s.num_samples for s in out.scheduled if s.num_samples}
        t0 = time.perf_counter()
        for req, tokens in sched.update_from_output(out, sampled):
            timings[req.request_id].token_times.extend([clock] * len(tokens))
        host += time.perf_counter() - t0
        steps += 1
        batch += len(out.scheduled)
        result.timeline.append((clock, len(sched.running), len(sched.waiting), kv.usage,
                                out.total_num_scheduled_tokens))
    stats = kv.stats()
    result.summary = summarize(list(timings.values()), clock)
    tl = result.timeline
    result.summary.update({
        "num_steps": steps, "mean_batch_size": batch / steps if steps else 0.0,
        "mean_tokens_per_step": sum(x[4] for x in tl) / steps if steps else 0.0,
        "mean_step_ms": 1000 * busy / steps if steps else 0.0,
        "max_kv_usage": max((x[3] for x in tl), default=0.0),
        "max_num_waiting": max((x[2] for x in tl), default=0),
        "num_preemptions": sched.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_hit_rate,
        "host_ms_per_step": 1000 * host / steps if steps else 0.0,
    })
    return result

"""Drives a real `LLMEngine` through a trace and records what each step and request did.

Everything is measured from outside the engine: `StepProbe` wraps the scheduler's
`schedule`/`update_from_output` and the runner's `dispatch`/`fetch` on the engine's
instances (the classes are untouched), so a step splits into scheduling, device execution
(input preparation and the wait for the device included) and the rest (sampling metadata,
detokenizing, outputs). With async scheduling one `engine.step()` schedules and dispatches
the next step and fetches and processes the one before.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field

from jaxserve.bench.stats import RequestTiming, summarize
from jaxserve.bench.workloads import TraceRequest, trace_token_ids
from jaxserve.sampling_params import SamplingParams


@dataclass
class StepRecord:
    """One engine step as seen from outside.

    Attributes:
        t: End of the step, seconds after the run started.
        seconds: Whole `engine.step()` wall time.
        schedule_s: In `Scheduler.schedule`.
        execute_s: In `ModelRunner.dispatch` and `fetch` (inputs, transfer, model, sampler,
            the wait for the device and the copy back).
        update_s: In `Scheduler.update_from_output`.
        num_tokens: Scheduled tokens.
        num_prefill_tokens: Of them, prompt tokens (chunks and whole prompts).
        num_seqs: Scheduled requests.
        num_running: Running requests after scheduling.
        num_waiting: Waiting requests after scheduling.
        kv_usage: Fraction of KV pages in use after scheduling.
    """

    t: float
    seconds: float
    schedule_s: float
    execute_s: float
    update_s: float
    num_tokens: int
    num_prefill_tokens: int
    num_seqs: int
    num_running: int
    num_waiting: int
    kv_usage: float


class StepProbe:
    """Times the phases of `engine.step()` by wrapping bound methods on the instances.

    Use as a context manager; the wrappers are removed on exit.
    """

    def __init__(self, engine):
        self.engine = engine
        self._phase: dict[str, float] = {}
        self._scheduled: list[tuple[int, int, int]] = []

    def __enter__(self) -> StepProbe:
        sched, runner = self.engine.scheduler, self.engine.runner
        self._targets = [(sched, "schedule"), (sched, "update_from_output"),
                         (runner, "dispatch"), (runner, "fetch")]
        for obj, name in self._targets:
            setattr(obj, name, self._wrap(getattr(obj, name), name))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in self._targets:
            delattr(obj, name)  # the class's method shows through again

    def _wrap(self, fn, name):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            res = fn(*args, **kwargs)
            self._phase[name] = self._phase.get(name, 0.0) + time.perf_counter() - t0
            if name == "schedule":
                self._scheduled.append(self._count(res))
            return res
        return timed

    def _count(self, out) -> tuple[int, int, int]:
        """(tokens, prompt tokens, requests) of a step, counted as it is scheduled."""
        prefill = 0
        for s in out.scheduled:
            req = self.engine.scheduler.requests[s.request_id]
            prefill += max(0, min(s.start_pos + s.num_new_tokens, req.num_prompt_tokens)
                           - s.start_pos)
        return out.total_num_scheduled_tokens, prefill, len(out.scheduled)

    def step(self, start: float) -> tuple[list, StepRecord | None]:
        """Runs `engine.step()`; returns its outputs and the record (None if it scheduled
        nothing). With async scheduling the first call may schedule two steps (the first,
        then the next while the first runs): the record counts both."""
        eng = self.engine
        self._phase.clear()
        self._scheduled.clear()
        t0 = time.perf_counter()
        outputs = eng.step()
        t1 = time.perf_counter()
        counts = [c for c in self._scheduled if c[0]]
        if not counts:
            return outputs, None
        rec = StepRecord(
            t=t1 - start, seconds=t1 - t0, schedule_s=self._phase.get("schedule", 0.0),
            execute_s=self._phase.get("dispatch", 0.0) + self._phase.get("fetch", 0.0),
            update_s=self._phase.get("update_from_output", 0.0),
            num_tokens=sum(c[0] for c in counts), num_prefill_tokens=sum(c[1] for c in counts),
            num_seqs=max(c[2] for c in counts), num_running=len(eng.scheduler.running),
            num_waiting=len(eng.scheduler.waiting), kv_usage=eng.kv.usage)
        return outputs, rec


@dataclass
class RunResult:
    """A finished run: per-request timings, per-step records, the summary and metrics."""

    summary: dict
    timings: list[RequestTiming]
    steps: list[StepRecord] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """Summary, metrics, step records and token times, JSON-ready."""
        return {"summary": self.summary, "metrics": self.metrics,
                "steps": [asdict(s) for s in self.steps],
                "requests": [{"arrival": t.arrival, "prompt_len": t.prompt_len,
                              "token_times": t.token_times} for t in self.timings]}


def step_summary(steps: list[StepRecord]) -> dict:
    """Mean step figures: batch, tokens, phase times (ms) and the host share."""
    n = len(steps)
    if not n:
        return {"num_steps": 0}
    tot = sum(s.seconds for s in steps)
    sched = sum(s.schedule_s for s in steps)
    exe = sum(s.execute_s for s in steps)
    upd = sum(s.update_s for s in steps)
    return {
        "num_steps": n,
        "mean_batch_size": sum(s.num_seqs for s in steps) / n,
        "mean_tokens_per_step": sum(s.num_tokens for s in steps) / n,
        "mean_step_ms": 1000 * tot / n,
        "mean_schedule_ms": 1000 * sched / n,
        "mean_execute_ms": 1000 * exe / n,
        "mean_update_ms": 1000 * upd / n,
        "mean_other_host_ms": 1000 * (tot - sched - exe - upd) / n,
        "max_kv_usage": max(s.kv_usage for s in steps),
        "max_num_waiting": max(s.num_waiting for s in steps),
    }


def run_trace(engine, trace: list[TraceRequest], token_ids: list[list[int]] | None = None, *,
              replay_arrivals: bool = False, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, prefix: str = "bench",
              sampling: dict | None = None) -> RunResult:
    """Runs every request of `trace` to its `output_len` (EOS ignored) on `engine`.

    Args:
        engine: A warmed-up `LLMEngine` with no requests.
        trace: The requests.
        token_ids: Prompt ids per request (default: `trace_token_ids` of the trace).
        replay_arrivals: Add each request at its arrival time (wall clock); otherwise all
            at once at the start (offline throughput).
        slo_ttft_ms, slo_tpot_ms: Goodput bounds passed to `summarize`.
        sampling: `SamplingParams` fields for every request (say temperature, top_p,
            top_k); default greedy. Request i is seeded with i, so runs draw alike.

    Returns:
        Summary (the `summarize` fields, plus step means, prefix hit rate and preemptions),
        per-request timings and per-step records.
    """
    if token_ids is None:
        token_ids = trace_token_ids(trace, engine.model.cfg.vocab_size,
                                    avoid=tuple(engine.eos_token_ids) + (0, 1))
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_time)
    timings = [RequestTiming(0.0, r.prompt_len) for r in trace]
    seen = [0] * len(trace)
    index = {f"{prefix}-{i}": i for i in range(len(trace))}
    m0 = engine.get_metrics()
    steps: list[StepRecord] = []
    gc.collect()
    nxt = 0
    with StepProbe(engine) as probe:
        start = time.perf_counter()
        while nxt < len(order) or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while nxt < len(order) and (not replay_arrivals
                                        or trace[order[nxt]].arrival_time <= now):
                i = order[nxt]
                r = trace[i]
                timings[i].arrival = r.arrival_time if replay_arrivals else 0.0
                engine.add_request(f"{prefix}-{i}", {"prompt_token_ids": token_ids[i]},
                                   SamplingParams(**{"temperature": 0.0, **(sampling or {})},
                                                  max_tokens=r.output_len, ignore_eos=True,
                                                  detokenize=True, seed=i))
                nxt += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, trace[order[nxt]].arrival_time - now))
                continue
            outputs, rec = probe.step(start)
            if rec is not None:
                steps.append(rec)
            t = time.perf_counter() - start
            for out in outputs:
                i = index[out.request_id]
                n = len(out.outputs[0].token_ids)
                timings[i].token_times.extend([t] * (n - seen[i]))
                seen[i] = n
        duration = time.perf_counter() - start
    return _result(engine, m0, timings, steps, duration, slo_ttft_ms, slo_tpot_ms)


def _result(engine, m0: dict, timings: list[RequestTiming], steps: list[StepRecord],
            duration: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> RunResult:
    """A run's summary from its timings, steps and the engine's metrics before (`m0`)."""
    m1 = engine.get_metrics()
    delta = {k: m1[k] - m0.get(k, 0) for k in m1 if isinstance(m1[k], (int, float))}
    queries = delta.get("jaxserve:prefix_cache_queries", 0)
    summary = summarize(timings, duration, slo_ttft_ms, slo_tpot_ms)
    summary.update(step_summary(steps))
    summary.update({
        "num_preemptions": delta.get("jaxserve:num_preemptions", 0),
        "prefix_cache_hit_rate": delta.get("jaxserve:prefix_cache_hits", 0) / queries
        if queries else 0.0,
        "num_compilations": m1.get("jaxserve:num_compilations", 0),
        "padding_waste_ratio": m1.get("jaxserve:padding_waste_ratio", 0.0),
    })
    return RunResult(summary, timings, steps, delta)


def make_llm(model, tokenizer, mode: str = "continuous+chunked", **engine_args):
    """An `LLM` over a loaded model in a scheduling mode.

    Without chunking the token budget must hold a whole prompt, so a
    `max_num_batched_tokens` given for the chunked mode is dropped for the others (they
    take the engine default, max_model_len).
    """
    from jaxserve.engine.llm import LLM

    args = dict(engine_args)
    if mode != "continuous+chunked":
        budget = args.get("max_num_batched_tokens")
        mml = args.get("max_model_len")
        if budget is not None and mml is not None and budget < mml:
            args.pop("max_num_batched_tokens")
    return LLM(model, tokenizer=tokenizer, scheduling_mode=mode, **args)

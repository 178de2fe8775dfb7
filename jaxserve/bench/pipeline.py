"""Device idle time between steps, synchronous vs async scheduling, on a simulated accelerator.

On this CPU the "device" (XLA) shares the cores with the host, so whether host work hides
behind the device step cannot be seen directly. This benchmark gives a real `LLMEngine`
(a tiny random model, real scheduler, detokenizer and outputs) an accelerator that runs
beside the host: each dispatched step occupies the device for the simulator's cost of that
step (`bench.simulator` presets), starting when it is dispatched or when the step before it
ends, whichever is later; fetching a step waits (sleeps) until it ends. Timestamps of
every dispatch and simulated completion give the device's idle time between steps, and
with it the host time on the critical path (the host work the device waited for).

`MeasuredDevice` times the real device instead (here: XLA on the CPU): a watcher thread
blocks on each dispatched step's outputs and stamps when they are ready.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import jax
import numpy as np

from jaxserve.sampling_params import RequestOutputKind, SamplingParams


class SimulatedDevice:
    """Wraps an engine's runner so each step also takes `step_seconds` of device time.

    Args:
        engine: The `LLMEngine` (its runner's `dispatch`/`fetch` are wrapped on the
            instance until `close`).
        step_seconds: `SchedulerOutput -> seconds` of one step on the device.
    """

    def __init__(self, engine, step_seconds):
        self.runner = engine.runner
        self.step_seconds = step_seconds
        self.spans: list[tuple[float, float, float]] = []  # (dispatched, start, end)
        self._end: dict[int, float] = {}
        dispatch, fetch = self.runner.dispatch, self.runner.fetch

        def timed_dispatch(out, *args, **kwargs):
            pending = dispatch(out, *args, **kwargs)
            now = time.perf_counter()
            start = max(now, self.spans[-1][2]) if self.spans else now
            end = start + self.step_seconds(out)
            self.spans.append((now, start, end))
            self._end[id(pending)] = end
            return pending

        def timed_fetch(pending):
            result = fetch(pending)
            wait = self._end.pop(id(pending), 0.0) - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return result

        self.runner.dispatch, self.runner.fetch = timed_dispatch, timed_fetch

    @property
    def num_dispatched(self) -> int:
        return len(self.spans)

    def close(self) -> None:
        del self.runner.dispatch, self.runner.fetch

    def idle(self, first: int = 0) -> tuple[float, float]:
        """(seconds the device sat idle between steps, seconds from the first step's start
        to the last one's end), over the spans from index `first`."""
        return _idle(self.spans[first:])


class MeasuredDevice:
    """Wraps an engine's runner to stamp when each dispatched step really ends.

    A watcher thread blocks on each step's sampled ids (the last thing a step computes)
    in dispatch order and stamps the moment they are ready. A step starts when it is
    dispatched or when the step before it ends, whichever is later (the device runs
    steps in order: each one reads the KV pages the one before it wrote). The watcher
    wakes while the engine's thread runs Python, so the interpreter's switch interval is
    lowered to 0.1 ms while the device is watched (the stamps are late by at most that).

    Args:
        engine: The `LLMEngine` (its runner's `dispatch` is wrapped on the instance until
            `close`).
    """

    def __init__(self, engine):
        self.runner = engine.runner
        self._dispatched: list[float] = []
        self._ends: list[float] = []
        self._steps: queue.Queue = queue.Queue()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        dispatch = self.runner.dispatch

        def timed_dispatch(out, *args, **kwargs):
            pending = dispatch(out, *args, **kwargs)
            self._dispatched.append(time.perf_counter())
            self._steps.put(pending.next_input_ids)
            return pending

        self.runner.dispatch = timed_dispatch

    def _watch(self) -> None:
        while (ids := self._steps.get()) is not None:
            jax.block_until_ready(ids)
            self._ends.append(time.perf_counter())

    @property
    def num_dispatched(self) -> int:
        return len(self._dispatched)

    @property
    def spans(self) -> list[tuple[float, float, float]]:
        """(dispatched, start, end) of every step whose end was stamped, in order."""
        out: list[tuple[float, float, float]] = []
        for sent, end in zip(self._dispatched, self._ends, strict=False):
            start = max(sent, out[-1][2]) if out else sent
            out.append((sent, start, end))
        return out

    def settle(self) -> None:
        """Waits until every dispatched step's end is stamped."""
        while len(self._ends) < len(self._dispatched):
            time.sleep(1e-3)

    def close(self) -> None:
        self.settle()
        self._steps.put(None)
        self._thread.join()
        sys.setswitchinterval(self._switch)
        del self.runner.dispatch

    def idle(self, first: int = 0) -> tuple[float, float]:
        """As `SimulatedDevice.idle`, over the stamped steps."""
        self.settle()
        return _idle(self.spans[first:])


def _idle(spans: list[tuple[float, float, float]]) -> tuple[float, float]:
    gaps = [max(0.0, b[1] - a[2]) for a, b in zip(spans, spans[1:], strict=False)]
    return sum(gaps), spans[-1][2] - spans[0][1]


def pipeline_run(llm, num_running: int, step_seconds, *, overlap: bool, prompt_len: int = 32,
                 num_steps: int = 30) -> dict:
    """Decodes `num_running` requests and times the device; idle time and step figures.

    Args:
        llm: An `LLM` over a cheap model, `max_num_seqs` >= num_running.
        step_seconds: Device cost model, `SchedulerOutput -> seconds` (a simulated
            device), or None: the real device's steps, timed (`MeasuredDevice`).
        overlap: Async scheduling on or off.

    Returns:
        Per decode step (means over `num_steps` steady steps, ms): wall time, device
        time, idle time between steps and its share of the span.
    """
    eng = llm.engine
    eng.async_scheduling = overlap
    rng = np.random.default_rng(num_running)
    ids = [f"pipe{int(overlap)}-{num_running}-{i}" for i in range(num_running)]
    top = min(30000, eng.model.cfg.vocab_size)
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": rng.integers(3, top, prompt_len).tolist()},
                        SamplingParams(max_tokens=eng.limits.max_model_len - prompt_len - 1,
                                       ignore_eos=True, temperature=0.0,
                                       output_kind=RequestOutputKind.CUMULATIVE))
    sched = eng.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        eng.step()
    device = (MeasuredDevice(eng) if step_seconds is None
              else SimulatedDevice(eng, step_seconds))
    try:
        for _ in range(3):  # into the steady pipeline
            eng.step()
        first = device.num_dispatched
        t0 = time.perf_counter()
        for _ in range(num_steps):
            eng.step()
        wall = time.perf_counter() - t0
        idle, span = device.idle(first)
        busy = sum(e - s for _, s, e in device.spans[first:])
    finally:
        device.close()
        eng.abort_request(ids)
        eng.flush()
    n = len(device.spans) - first
    return {"num_running": num_running, "async": overlap,
            "step_ms": 1000 * wall / num_steps, "device_ms": 1000 * busy / max(n, 1),
            "idle_ms": 1000 * idle / max(n - 1, 1),
            "idle_share": idle / span if span else 0.0}


def cost_model_seconds(preset: str):
    """`SchedulerOutput -> seconds` under a `bench.simulator` preset."""
    from jaxserve.bench.simulator import PRESETS

    cost = PRESETS[preset]

    def seconds(out) -> float:
        kv_tokens = sum(s.start_pos + s.num_new_tokens for s in out.scheduled)
        return cost.step_seconds(out.total_num_scheduled_tokens, len(out.scheduled), kv_tokens)

    return seconds

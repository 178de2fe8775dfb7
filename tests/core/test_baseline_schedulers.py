"""The benchmarks' batching baselines (`jaxserve.core.baseline_schedulers`): the scheduler variants
of `scheduling_mode` "naive" and "static", checked step by step by the scheduler harness,
and the engine and simulator building them from the mode."""

from __future__ import annotations

import pytest

from jaxserve.bench.simulator import PRESETS, simulate
from jaxserve.bench.workloads import TraceRequest
from jaxserve.config import SchedulerConfig
from jaxserve.core.baseline_schedulers import NaiveScheduler, StaticBatchScheduler, scheduler_class
from jaxserve.core.scheduler import Scheduler
from tests.core.scheduler_harness import Harness, make_request, make_scheduler, scheduled


def test_naive_mode_runs_one_request_at_a_time():
    h = Harness(make_scheduler(max_num_seqs=8, scheduling_mode="naive",
                               scheduler_class=NaiveScheduler))
    assert h.sched.max_num_seqs == 1
    h.add(*(make_request(f"r{i}", 5, max_tokens=3, arrival=i) for i in range(3)))
    h.run()
    order = [list(scheduled(o)) for o in h.outputs]
    assert order == [["r0"]] * 3 + [["r1"]] * 3 + [["r2"]] * 3


def test_static_mode_admits_a_batch_only_after_the_last_one_finished():
    h = Harness(make_scheduler(max_num_seqs=2, scheduling_mode="static",
                               scheduler_class=StaticBatchScheduler))
    h.add(make_request("a", 5, max_tokens=2), make_request("b", 5, max_tokens=5, arrival=1),
          make_request("c", 5, max_tokens=2, arrival=2))
    h.run()
    order = [sorted(scheduled(o)) for o in h.outputs]
    assert order == [["a", "b"]] * 2 + [["b"]] * 3 + [["c"]] * 2


@pytest.mark.parametrize("mode, cls", [("naive", NaiveScheduler),
                                       ("static", StaticBatchScheduler),
                                       ("continuous", Scheduler),
                                       ("continuous+chunked", Scheduler)])
def test_each_mode_has_its_scheduler(mode, cls):
    assert scheduler_class(mode) is cls
    res = simulate([TraceRequest(8, 4)] * 3, PRESETS["gpu-8b"],
                   SchedulerConfig(max_num_seqs=4, scheduling_mode=mode), num_pages=64,
                   max_num_batched_tokens=64)
    assert res.summary["mean_batch_size"] == pytest.approx(1.0 if mode == "naive" else 3.0)


@pytest.mark.parametrize("mode, cls", [("static", Scheduler), ("naive", Scheduler),
                                       ("continuous", StaticBatchScheduler),
                                       ("static", NaiveScheduler)])
def test_a_scheduler_refuses_a_mode_it_does_not_serve(mode, cls):
    """The production scheduler never runs a baseline mode as continuous batching (and a
    baseline never runs another's): building it for one names the factory."""
    with pytest.raises(ValueError, match=f"scheduling_mode='{mode}' is not {cls.__name__}'s"
                                         ".*scheduler_class"):
        make_scheduler(scheduling_mode=mode, scheduler_class=cls)

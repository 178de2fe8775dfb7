"""The benchmarks' batching baselines as scheduler variants: static batching and one request
at a time (`scheduling_mode` "static" and "naive"), outside the production `Scheduler`.

`jaxserve bench throughput` (`jaxserve.bench.throughput`) and the scheduler simulator
(`jaxserve.bench.simulator`) compare them with continuous batching, with and without
chunked prefill (the production `Scheduler`, whose `SchedulerConfig.chunked` follows
`scheduling_mode` "continuous+chunked" / "continuous"). They live in `core`, not in
`jaxserve.bench`, because the engine builds them too: an engine given
`scheduling_mode="static"` or `"naive"` (engine arguments the README documents as the
benchmarks' comparison points) schedules with them (`scheduler_class`), and the engine
layer may not import the benchmarks. Neither chunks prompts.
"""

from __future__ import annotations

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler


class StaticBatchScheduler(Scheduler):
    """Static batching: a batch is admitted only when nothing runs, and it runs until its
    slowest request finishes (no request joins it meanwhile); the scheduler's arguments."""

    MODES = ("static",)

    def may_admit(self) -> bool:
        """Only when no request runs (preempted ones wait for the batch to drain)."""
        return not self.running


class NaiveScheduler(StaticBatchScheduler):
    """One request at a time: static batches of one (`max_num_seqs` is 1 whatever the
    configuration says); the scheduler's arguments."""

    MODES = ("naive",)

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 max_num_batched_tokens: int, max_loras: int | None = None):
        super().__init__(config, kv, max_model_len, max_num_batched_tokens, max_loras)
        self.max_num_seqs = 1


BASELINES: dict[str, type[Scheduler]] = {"static": StaticBatchScheduler,
                                         "naive": NaiveScheduler}


def scheduler_class(scheduling_mode: str) -> type[Scheduler]:
    """The scheduler of a `SchedulerConfig.scheduling_mode`: a baseline above for "static"
    and "naive", the production `Scheduler` for "continuous" and "continuous+chunked"."""
    return BASELINES.get(scheduling_mode, Scheduler)

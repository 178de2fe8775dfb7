"""The engine's figures: capacity, progress, vLLM-named counters and gauges (`get_metrics`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.core.scheduler import Scheduler
    from jaxserve.engine.output_processor import OutputProcessor
    from jaxserve.engine.pooling import Pooler
    from jaxserve.engine.weight_control import WeightControl
    from jaxserve.runner.worker import Worker

# The finish reasons vLLM's `request_success` shows from the start (others when they occur).
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    """Reads an engine's parts (never changes them) and reports its figures.

    Args:
        worker: The engine's `Worker` (its runner built: `Worker.init_device`).
        scheduler: The engine's `Scheduler` (and through it the `KVCacheManager`).
        outputs: The engine's `OutputProcessor` (token and finish counts).
        weights: The engine's `WeightControl` (its sleep level).
        speculator: The engine's speculator, or None.
        pooler: The engine's `Pooler` (a pooling engine), or None.
    """

    def __init__(self, worker: Worker, scheduler: Scheduler, outputs: OutputProcessor,
                 weights: WeightControl, speculator=None, pooler: Pooler | None = None):
        self.worker = worker
        self.scheduler = scheduler
        self.outputs = outputs
        self.weights = weights
        self.speculator = speculator
        self.pooler = pooler

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (every page but the null page)."""
        return self.worker.kv_capacity_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the engine's steps have computed so far."""
        return self.worker.runner.num_scheduled_tokens

    @property
    def num_iteration_tokens(self) -> int:
        """Prompt plus generated tokens the engine's iterations have processed, as vLLM
        counts them: a request's prompt when its first token comes, every new token."""
        return self.num_prompt_tokens + self.outputs.num_generation_tokens

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens counted as vLLM's `prompt_tokens`: when the request's first token
        comes (each completion of an n > 1 request), or when a pooling request is added."""
        pooled = 0 if self.pooler is None else self.pooler.num_prompt_tokens
        return self.outputs.num_prompt_tokens + pooled

    @property
    def warmup_progress(self) -> tuple[int, int]:
        """(buckets compiled, buckets in all) while warm-up runs."""
        return self.worker.runner.warmup_progress

    def cache_config_info(self) -> dict[str, object]:
        """The KV cache's settings, labelled as vLLM's `cache_config_info`
        (`enable_prefix_caching` as served: vLLM turns it off in the config for a model it
        cannot cache, as the KV manager does here: `prefix_caching_enabled`)."""
        cache = self.worker.config.cache
        return {"block_size": cache.block_size, "num_gpu_blocks": self.worker.limits.num_pages,
                "enable_prefix_caching": cache.enable_prefix_caching
                and self.scheduler.kv.prefix_caching_disabled_reason is None,
                "gpu_memory_utilization": cache.gpu_memory_utilization,
                "swap_space": cache.swap_space, "cache_dtype": cache.kv_cache_dtype}

    def prefix_caching_enabled(self) -> dict[str, float]:
        """The gauge `prefix_caching_enabled`: 1 when prefix caching serves, else 0 with
        why in its `reason` label (the KV manager's `prefix_caching_disabled_reason`, e.g.
        a model with linear-attention layers; or the setting), commas made semicolons
        (the snapshot's label syntax splits on commas)."""
        kv = self.scheduler.kv
        on = kv.pool.prefix_cache is not None
        reason = "" if on else kv.prefix_caching_disabled_reason or (
            "enable_prefix_caching is False" if not self.worker.config.cache.enable_prefix_caching
            else "off for this pooling type")  # a pooler that reads every token (`Pooler`)
        return {f"jaxserve:prefix_caching_enabled{{reason={reason.replace(',', ';')}}}":
                float(on)}

    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges, named like vLLM's with a `jaxserve:` prefix."""
        sched, runner, limits = self.scheduler, self.worker.runner, self.worker.limits
        kv = sched.kv
        stats = kv.stats()
        padded = runner.num_padded_tokens
        total = padded + runner.num_scheduled_tokens
        metrics = {
            "jaxserve:num_requests_running": len(sched.running),
            "jaxserve:num_requests_waiting": len(sched.waiting),
            "jaxserve:num_requests_swapped": len(sched.swapped),
            "jaxserve:kv_cache_usage_perc": stats.usage,
            "jaxserve:kv_cache_capacity_tokens": self.kv_capacity_tokens,
            # every group's page of a token (a sliding group's are given back later)
            "jaxserve:kv_cache_bytes_per_token": limits.bytes_per_page
            * kv.num_groups / kv.page_size,
            "jaxserve:weight_bytes": self.worker.model.weight_bytes,
            "jaxserve:prefix_cache_queries": stats.prefix_queries,
            "jaxserve:prefix_cache_hits": stats.prefix_hits,
            "jaxserve:num_preemptions": sched.num_preemptions,
            "jaxserve:prompt_tokens": self.num_prompt_tokens,
            "jaxserve:generation_tokens": self.outputs.num_generation_tokens,
            "jaxserve:num_compilations": runner.num_compilations + (
                self.speculator.num_compilations if self.speculator is not None else 0),
            "jaxserve:padding_waste_ratio": padded / total if total else 0.0,
            "jaxserve:warmup_seconds": runner.warmup_seconds,
            "jaxserve:num_cow_copies": stats.num_cow_copies,
            "jaxserve:num_swap_outs": stats.num_swap_outs,
            "jaxserve:num_swap_ins": stats.num_swap_ins,
            **self.prefix_caching_enabled(),
        }
        if self.speculator is not None:
            metrics.update(self.speculator.metrics())
        if runner.encoder is not None:  # a model taking images: its encoder cache
            metrics.update(runner.encoder.metrics())
        finished = self.outputs.finished_reasons
        for reason in (*FINISH_REASONS, *finished):  # vLLM's, from 0
            metrics[f"jaxserve:request_success{{finished_reason={reason}}}"] = \
                finished.get(reason, 0)
        # NOTE: as vLLM's gauge, the level counts while the weights sleep; with only the
        # KV cache asleep (a partial wake) no state is on.
        asleep = self.weights.sleeping_tags
        level = self.weights.sleep_level if "weights" in asleep else 0
        for state, on in (("awake", not asleep), ("weights_offloaded", level == 1),
                          ("discard_all", level == 2)):
            metrics[f"jaxserve:engine_sleep_state{{sleep_state={state}}}"] = float(on)
        return metrics

"""Data-parallel attention with expert parallelism: what an engine serves with it, and the
KV cache manager it schedules with.

With `ParallelConfig.enable_dp_attention` the `expert_parallel_size` devices of the
"expert" axis are attention ranks: the scheduler gives every request a rank
(`jaxserve.core.ranked_kv.RankedKVCacheManager`, whose ranks each own 1/n of the pages),
the runner lays each step out rank by rank (`jaxserve.runner.rank_steps`), each device
attends its rank's requests on its share of the pool (`pallas_kernels.rank_split`), and
the tokens meet at the experts (`models.moe_parallel.sharded_experts`). The model-side
conditions (a mixture of experts, no linear-attention layers, tensor parallelism 1) are
`jaxserve.parallel.layouts.check_dp_attention`'s.
"""

from __future__ import annotations

from jaxserve.config import EngineConfig


def check_engine_config(config: EngineConfig) -> None:
    """Refuses the engine features data-parallel attention does not serve yet.

    Raises:
        ValueError: LoRA adapters, a pooling runner, routing capture, a draft model, an
            EAGLE-3 head or an MTP layer with `enable_dp_attention` (each names the setting).
    """
    if not config.parallel.enable_dp_attention:
        return
    spec = config.speculative_config
    refused = {
        "enable_lora": config.lora.enable_lora,
        'runner="pooling"': config.model.runner == "pooling",
        "enable_return_routed_experts": config.model.enable_return_routed_experts,
        "speculative_config.method='draft_model'": spec is not None
        and spec.method == "draft_model",
        "speculative_config.method='eagle3'": spec is not None and spec.method == "eagle3",
        "speculative_config.method='mtp'": spec is not None and spec.method == "mtp",
    }
    for name, on in refused.items():
        if on:
            raise ValueError(f"enable_dp_attention does not serve {name} yet (each "
                             "attention rank would need its own share of it); n-gram "
                             "speculation, prefix caching and both preemption modes are served")


def make_kv_cache_manager(num_ranks: int, num_pages: int, page_size: int, **kwargs):
    """The engine's KV cache manager: a `KVCacheManager`, or with several attention ranks a
    `RankedKVCacheManager` splitting `num_pages` between them (same keyword arguments)."""
    from jaxserve.core.kv_cache_manager import KVCacheManager

    if num_ranks == 1:
        return KVCacheManager(num_pages, page_size, **kwargs)
    from jaxserve.core.ranked_kv import RankedKVCacheManager

    return RankedKVCacheManager(num_ranks, num_pages, page_size, **kwargs)

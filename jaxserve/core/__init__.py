"""Host-side engine core in plain Python and NumPy (no JAX): scheduling and the KV cache.

The scheduler (`Scheduler`) decides each step's `{request_id: num_new_tokens}` and hands
the model runner a `SchedulerOutput`; the KV cache manager (`KVCacheManager`) places every
request's tokens in device pages, shares them (prefix cache, forks with copy-on-write)
and swaps them to host slots.

Vocabulary: the unit of KV memory is a *page* (`page_size` token slots, a `KVPage` in
the `PagePool`; page 0 is the null page). A request's ordered list of page ids is its
*block table*, the kernels' term (`block_tables`). The engine argument `block_size`
(vLLM's name) is the page size.

NOTE: nothing here may import jax; the scheduler and KV cache manager must stay testable
in milliseconds and reusable in a simulator.
"""

from jaxserve.core.block_tables import BlockTables, RequestKV
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_metrics import KVCacheCounters, KVCacheStats
from jaxserve.core.kv_page import NULL_PAGE_ID, KVPage
from jaxserve.core.page_pool import FreePageQueue, HostPool, PagePool
from jaxserve.core.plans import CopyPlan, KVPlans, SwapPlan
from jaxserve.core.prefix_cache import PrefixCache, hash_page_tokens
from jaxserve.core.ranked_kv import RankedKVCacheManager

__all__ = [
    "NULL_PAGE_ID",
    "BlockTables",
    "CopyPlan",
    "FreePageQueue",
    "HostPool",
    "KVCacheCounters",
    "KVCacheManager",
    "KVCacheStats",
    "KVPage",
    "KVPlans",
    "PagePool",
    "PrefixCache",
    "RankedKVCacheManager",
    "RequestKV",
    "SwapPlan",
    "hash_page_tokens",
]

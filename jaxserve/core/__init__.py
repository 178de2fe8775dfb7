"""Host-side engine core in plain Python and NumPy (no JAX): KV cache management.

NOTE: nothing here may import jax; the scheduler and block manager must stay testable
in milliseconds and reusable in a simulator.
"""

from jaxserve.core.block_pool import NULL_PAGE_ID, BlockPool, FreePageQueue, HostPool, KVPage
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_metrics import KVCacheCounters, KVCacheStats
from jaxserve.core.plans import CopyPlan, KVPlans, SwapPlan
from jaxserve.core.prefix_cache import PrefixCache, hash_page_tokens

__all__ = [
    "NULL_PAGE_ID",
    "BlockPool",
    "CopyPlan",
    "FreePageQueue",
    "HostPool",
    "KVCacheCounters",
    "KVCacheManager",
    "KVCacheStats",
    "KVPage",
    "KVPlans",
    "PrefixCache",
    "SwapPlan",
    "hash_page_tokens",
]

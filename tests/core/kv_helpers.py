"""Helpers for KVCacheManager tests: a small manager, admit/decode steps, state snapshots."""

from __future__ import annotations

import copy

from jaxserve.core import KVCacheManager
from jaxserve.request import Request

PS = 4


def make(num_pages: int = 17, **kwargs) -> KVCacheManager:
    kwargs.setdefault("watermark", 0.0)
    return KVCacheManager(num_pages, PS, **kwargs)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """Prefix lookup, allocation and the step's compute for a new request."""
    hit_ids, num_hit = manager.get_computed_pages(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new_ids = manager.allocate_slots(request, num_new_tokens, num_hit, hit_ids)
    if new_ids is not None:
        request.num_computed_tokens += num_hit + num_new_tokens
        manager.take_plans()
    return hit_ids, new_ids


def decode(manager: KVCacheManager, request: Request, token_id: int):
    request.append_output_token_ids(token_id)
    new_ids = manager.allocate_slots(request, 1)
    if new_ids is not None:
        request.num_computed_tokens += 1
    return new_ids


def snapshot(manager: KVCacheManager) -> dict:
    """Everything observable about the manager, for before/after comparisons."""
    pool, pending = manager.pool, manager.tables.pending
    return copy.deepcopy({
        "requests": {rid: ([p.page_id for p in s.pages], s.host_slot_ids, s.num_cached_pages,
                           s.num_slot_tokens) for rid, s in manager.tables.requests.items()},
        "offers": {rid: n for rid, (_, n) in manager.tables._offers.items()},
        "pages": [(p.page_id, p.ref_cnt, p.page_hash, p.token_ids) for p in pool.pages],
        "free_queue": [p.page_id for p in pool.free_queue],
        "num_cached_free": pool.num_cached_free_pages,
        "index": {h: p.page_id for h, p in pool.prefix_cache._pages.items()},
        "host_free": list(manager.host_pool._free_slot_ids),
        "pending": (pending.swap_out_pairs, pending.swap_in_src, pending.copy_src,
                    pending.pins, pending.deferred_slot_ids),
        "counters": manager.counters,
    })

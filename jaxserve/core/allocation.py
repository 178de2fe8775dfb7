"""Allocation planning: what one `allocate_slots` call would take, and whether it fits."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.block_tables import BlockTables
from jaxserve.core.kv_page import KVPage, group_key
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.request import Request
from jaxserve.utils import cdiv


@dataclass
class AllocationPlan:
    """What an allocation takes from the pool; nothing has changed yet.

    Attributes:
        computed_pages: Per KV cache group, prefix-hit pages to put at the head of a new
            table (null pages where a sliding group's window does not reach).
        cow: (group, table index) of each shared page this step writes into (each gets a
            private copy).
        num_new_pages: Pages to append to each group's table.
        num_computed_tokens: The request's computed tokens, prefix hits included.
        num_tokens_after: Tokens the request's pages hold once this step has run.
        fits: Whether the pool has the pages (the watermark applies to a new table).
    """

    computed_pages: list[list[KVPage]]
    cow: list[tuple[int, int]]
    num_new_pages: int
    num_computed_tokens: int
    num_tokens_after: int
    fits: bool


def plan_allocation(tables: BlockTables, request: Request, num_new_tokens: int,
                    num_new_computed_tokens: int, hit_ids: list[list[int]],
                    num_lookahead_tokens: int, *, max_model_len: int | None,
                    watermark_pages: int, num_freed: int = 0) -> AllocationPlan:
    """Plans `KVCacheManager.allocate_slots` (see there for the arguments; `hit_ids` holds
    one list of page ids per group; `num_freed` pages go back first, outside a sliding
    group's window).

    Raises:
        ValueError: Negative counts, a swapped-out request, stale or mismatched hit
            pages, more tokens than the request has, or more pages than exist.
    """
    ps, pool, request_id = tables.page_size, tables.pool, request.request_id
    counts = {"num_new_tokens": num_new_tokens, "num_lookahead_tokens": num_lookahead_tokens,
              "num_new_computed_tokens": num_new_computed_tokens}
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    state = tables.requests.get(request_id)
    if state is not None and state.is_swapped:
        raise ValueError(f"request {request_id!r} is swapped out; swap_in first")
    groups = state.tables if state is not None else [[] for _ in tables.windows]
    num_hit = len(hit_ids[0])
    if len(hit_ids) != len(groups) or any(len(ids) != num_hit for ids in hit_ids):
        raise ValueError(f"new_computed_page_ids must hold {len(groups)} equally long lists "
                         f"(one per KV cache group), got lengths {[len(i) for i in hit_ids]}")
    if num_hit * ps != num_new_computed_tokens:
        raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} must equal "
                         f"{num_hit} hit pages x page_size {ps}")
    if num_hit and (groups[0] or request.num_computed_tokens):
        raise ValueError(f"request {request_id!r}: prefix hits only on its first allocation")
    computed_pages = [[_hit_page(tables, request, g, i, pid) for i, pid in enumerate(ids)]
                      for g, ids in enumerate(hit_ids)]
    num_computed = request.num_computed_tokens + num_new_computed_tokens
    num_tokens_after = num_computed + num_new_tokens
    if num_tokens_after > request.num_tokens_with_placeholders:
        raise ValueError(f"request {request_id!r} has {request.num_tokens_with_placeholders} "
                         f"tokens (those in flight included); cannot "
                         f"schedule up to token {num_tokens_after}")
    num_slots = num_tokens_after + num_lookahead_tokens
    if max_model_len is not None and num_slots > max_model_len:
        raise ValueError(f"request {request_id!r} needs {num_slots} slots, over "
                         f"max_model_len={max_model_len}")
    num_required = cdiv(num_slots, ps)
    dropped = (tables.num_dropped_after(state, request.num_computed_tokens) if state is not None
               else [sum(1 for page in pages if page.is_null) for pages in computed_pages])
    num_held = sum(num_required - d for d in dropped)  # a sliding group's old pages are gone
    if num_held > pool.num_usable_pages:
        raise ValueError(f"request {request_id!r} needs {num_held} pages; the pool "
                         f"has only {pool.num_usable_pages}")
    num_new_pages = max(0, num_required - len(groups[0]) - num_hit)
    # NOTE: every shared page this step writes into needs a private copy first.
    # (proposals' lookahead slots are written too: speculative decoding)
    last_written = cdiv(num_slots, ps) if num_new_tokens else 0
    cow = [(g, i) for g, table in enumerate(groups)
           for i in range(num_computed // ps, min(len(table), last_written))
           if not table[i].is_null and tables.num_holders(table[i]) > 1]
    num_reclaimed = sum(1 for pages in computed_pages for page in pages
                        if page.ref_cnt == 0 and not page.is_null)
    num_needed = num_new_pages * len(groups) + len(cow) + num_reclaimed
    reserve = watermark_pages if state is None else 0
    fits = num_needed + reserve <= pool.num_allocatable_pages + num_freed
    return AllocationPlan(computed_pages, cow, num_new_pages, num_computed,
                          num_tokens_after, fits)


def _hit_page(tables: BlockTables, request: Request, group: int, index: int,
              page_id: int) -> KVPage:
    """The cached page `page_id` as page `index` of the request in `group` (the null page
    where a sliding group's window does not reach); raises if it is not."""
    pool = tables.pool
    if page_id == 0 and tables.windows[group] != 0:
        return pool.null_page
    if not 0 < page_id < pool.num_pages:
        raise ValueError(f"new_computed_page_ids holds page id {page_id}, outside "
                         f"[1, {pool.num_pages})")
    page = pool.pages[page_id]
    hashes = update_page_hashes(request, tables.page_size)
    if index >= len(hashes) or page.page_hash != group_key(hashes[index], group):
        raise ValueError(f"page {page_id} is not the cached page {index} of request "
                         f"{request.request_id!r} (stale get_computed_pages result?)")
    return page

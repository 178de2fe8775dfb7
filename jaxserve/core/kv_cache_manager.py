"""Host-side KV cache manager: block tables, prefix hits, forks with copy-on-write, swap."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.block_pool import KVPage
from jaxserve.core.block_tables import BlockTables, SwappedKV
from jaxserve.core.plans import SwapPlan
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _AllocationPlan:
    computed_pages: list[KVPage]
    cow_indices: list[int]
    num_new_pages: int
    num_computed_tokens: int
    num_tokens_after: int
    fits: bool


class KVCacheManager(BlockTables):
    """Owns every request's block table (page ids) over one device page pool.

    Call order per step (the scheduler's side): `get_computed_blocks` for a new request,
    `allocate_slots` for every scheduled request (None means preempt and retry),
    `swap_out`/`swap_in`/`free` as needed, then `take_plans()` once; the runner executes
    those plans before the step. Freeing or swapping out a request scheduled earlier in
    the same pass is fine (its unwritten pages never reach the prefix cache); forking
    one is not, since the child would share pages whose KV is not written yet.

    Args:
        num_pages: Device pages, the null page 0 included.
        page_size: Token slots per page.
        enable_prefix_caching: Reuse full pages across requests by chained hash.
        watermark: Fraction of pages kept free when admitting or swapping in a request.
        swap_space: Host swap pool size in GiB (0 disables swapping).
        bytes_per_page: Bytes one page holds across all layers (sizes the host pool).
        max_model_len: Longest sequence a request may reach (None: no limit).

    Raises:
        ValueError: A size or fraction outside its range.
    """

    # ------------------------------------------------------------- allocation
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Looks up cached pages for a request's leading full pages.

        The hit stops before the page holding the last token, so at least that token is
        computed (its logits are needed). The query is counted when the request's first
        `allocate_slots` succeeds, so a request that waits and looks up again each step
        counts once.

        Returns:
            (page ids of the hit, number of tokens they hold).

        Raises:
            ValueError: The request already holds pages or is swapped out.
        """
        if self.has_request(request.request_id):
            raise ValueError(f"request {request.request_id!r} already holds KV; "
                             "get_computed_blocks is for requests without pages")
        if self.pool.prefix_cache is None:
            return [], 0
        hashes = update_page_hashes(request, self.page_size)
        token_ids = request.all_token_ids
        ps = self.page_size
        hit_ids: list[int] = []
        for index in range((request.num_tokens - 1) // ps):
            page = self.pool.get_cached_page(hashes[index], token_ids[index * ps:(index + 1) * ps])
            if page is None:
                break
            hit_ids.append(page.page_id)
        return hit_ids, len(hit_ids) * ps

    def can_allocate(self, request: Request, num_new_tokens: int,
                     num_new_computed_tokens: int = 0, new_computed_blocks: list[int] | None = None,
                     num_lookahead_tokens: int = 0) -> bool:
        """Whether `allocate_slots` with these arguments would succeed (no side effects)."""
        return self._plan_allocation(request, num_new_tokens, num_new_computed_tokens,
                                     new_computed_blocks, num_lookahead_tokens).fits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens of `request` this step.

        Takes the prefix-hit pages (first allocation only), gives a private copy of any
        shared page this step writes into (recording a copy plan when it holds computed
        tokens), appends new pages, and queues newly full pages for the prefix cache
        (indexed at `take_plans()`).

        Args:
            request: The request; `request.num_computed_tokens` is its progress so far.
            num_new_tokens: Tokens to compute this step.
            num_new_computed_tokens: Tokens covered by `new_computed_blocks`.
            new_computed_blocks: Page ids from `get_computed_blocks`.
            num_lookahead_tokens: Extra slots to reserve (speculative tokens).

        Returns:
            Page ids newly placed in the table (copy-on-write replacements, then appended
            pages), or None when the pool is short (nothing changed; the watermark applies
            to a request's first allocation).

        Raises:
            ValueError: Negative counts, a swapped-out request, stale or mismatched hit
                pages, more tokens than the request has, or more pages than exist.
        """
        if not (num_new_computed_tokens or new_computed_blocks or num_lookahead_tokens):
            if self._fill_in_place(request, num_new_tokens):
                return []
        plan = self._plan_allocation(request, num_new_tokens, num_new_computed_tokens,
                                     new_computed_blocks, num_lookahead_tokens)
        if not plan.fits:
            return None
        request_id = request.request_id
        if request_id not in self._tables and self.pool.prefix_cache is not None:
            self.counters.prefix_queries += request.num_tokens
            self.counters.prefix_hits += num_new_computed_tokens
        table = self._tables.setdefault(request_id, [])
        self.pool.touch(plan.computed_pages)
        table.extend(plan.computed_pages)
        new_pages: list[KVPage] = []
        for index in plan.cow_indices:
            old = table[index]
            (page,) = self.pool.get_new_pages(1)
            if index * self.page_size < plan.num_computed_tokens:
                src_id = self._pending.resolve_copy_src(old.page_id)
                self.pool.touch([self.pool.pages[src_id]])  # pinned until take_plans()
                self._pending.add_copy(src_id, page.page_id)
                self.counters.num_cow_copies += 1
            table[index] = page
            self._release([old])
            new_pages.append(page)
        appended = self.pool.get_new_pages(plan.num_new_pages)
        table.extend(appended)
        new_pages.extend(appended)
        self._num_slot_tokens[request_id] = plan.num_tokens_after
        self._cache_full_pages(request, plan.num_tokens_after)
        return [page.page_id for page in new_pages]

    def _fill_in_place(self, request: Request, num_new_tokens: int) -> bool:
        """Fast path of `allocate_slots` (a decode step, most of them): the new tokens fit
        the request's own unshared pages. Does what the general path would and returns
        True, or returns False (nothing changed) to take the general path."""
        table = self._tables.get(request.request_id)
        if table is None or num_new_tokens < 0:
            return False
        ps = self.page_size
        num_after = request.num_computed_tokens + num_new_tokens
        if num_after > len(table) * ps or num_after > request.num_tokens or (
                self.max_model_len is not None and num_after > self.max_model_len):
            return False
        for index in range(request.num_computed_tokens // ps, _cdiv(num_after, ps)):
            if self._num_holders(table[index]) > 1:
                return False  # copy-on-write needed
        self._num_slot_tokens[request.request_id] = num_after
        self._cache_full_pages(request, num_after)
        return True

    # ------------------------------------------------------------------- swap
    def can_swap_out(self, request: Request) -> bool:
        """Whether `swap_out` would succeed now."""
        needed = self._num_swap_out_slots(self._table(request.request_id))
        return needed is not None and needed <= self.host_pool.num_free_slots

    def swap_out(self, request: Request) -> SwapPlan | None:
        """Moves a request's pages to host slots and frees the device pages.

        Returns:
            The request's (device page, host slot) pairs (also part of the next
            `take_plans()`), or None when host slots are short: nothing changed, so the
            caller falls back to recompute (`free` and restart from token 0).

        Raises:
            ValueError: Unknown or already swapped-out request.
        """
        request_id = request.request_id
        if request_id in self._swapped:
            raise ValueError(f"request {request_id!r} is already swapped out")
        table = self._table(request_id)
        if not self.can_swap_out(request):
            self.counters.num_swap_fallbacks += 1
            return None
        fresh_slots = iter(self.host_pool.allocate(self._num_swap_out_slots(table)))
        pairs, slot_ids = [], []
        for page in table:
            if page.page_id in self._pending.swap_in_src:
                # NOTE: swapped in this very step: the host slot still holds the content.
                slot_ids.append(self._pending.reclaim_swap_in(page.page_id))
                continue
            slot = next(fresh_slots)
            pairs.append((self._pending.resolve_copy_src(page.page_id), slot))
            slot_ids.append(slot)
        self._pending.swap_out_pairs.extend(pairs)
        # NOTE: swap-in re-offers these pages to the prefix cache; never pages past the
        # computed tokens, whose KV the host copy does not hold.
        num_cached_pages = min(self._num_cached_pages.get(request_id, 0),
                               request.num_computed_tokens // self.page_size)
        self._swapped[request_id] = SwappedKV(
            slot_ids, num_cached_pages, self._num_slot_tokens.get(request_id, 0))
        self._release(reversed(table))
        self._forget(request_id)
        self.counters.num_swap_outs += 1
        self.counters.num_swapped_out_pages += len(pairs)
        return SwapPlan(pairs, to_host=True)

    def can_swap_in(self, request: Request) -> bool:
        """Whether `swap_in` would succeed now (watermark included)."""
        swapped = self._swapped_request(request.request_id)
        return len(swapped.slot_ids) + self.watermark_pages <= self.pool.num_allocatable_pages

    def swap_in(self, request: Request) -> SwapPlan | None:
        """Brings a swapped-out request back into fresh device pages, same logical order.

        Returns:
            The (host slot, device page) pairs (also part of the next `take_plans()`), or
            None when device pages are short (nothing changed).

        Raises:
            ValueError: The request is not swapped out.
        """
        if not self.can_swap_in(request):
            return None
        request_id = request.request_id
        swapped = self._swapped.pop(request_id)
        pages = self.pool.get_new_pages(len(swapped.slot_ids))
        for slot, page in zip(swapped.slot_ids, pages, strict=True):
            self._pending.add_swap_in(slot, page.page_id)
        self._tables[request_id] = pages
        self._num_slot_tokens[request_id] = swapped.num_slot_tokens
        self._cache_full_pages(request, swapped.num_cached_pages * self.page_size)
        self.counters.num_swap_ins += 1
        self.counters.num_swapped_in_pages += len(pages)
        return SwapPlan([(s, p.page_id) for s, p in zip(swapped.slot_ids, pages, strict=True)],
                        to_host=False)

    # ---------------------------------------------------------------- helpers
    def _num_swap_out_slots(self, table: list[KVPage]) -> int | None:
        """Host slots a swap-out needs, or None if a page's content is still in flight."""
        needed = 0
        for page in table:
            if page.page_id in self._pending.swap_in_src:
                if page.ref_cnt != 1:
                    return None  # NOTE: shared or pinned mid-swap-in; recompute instead.
            elif self._pending.resolve_copy_src(page.page_id) in self._pending.swap_in_src:
                # NOTE: a copy of a page still arriving from the host: swap-out would run
                # before that swap-in and read nothing.
                return None
            else:
                needed += 1
        return needed

    def _hit_page(self, request: Request, index: int, page_id: int) -> KVPage:
        if not 0 < page_id < self.pool.num_pages:
            raise ValueError(f"new_computed_blocks holds page id {page_id}, outside "
                             f"[1, {self.pool.num_pages})")
        page = self.pool.pages[page_id]
        hashes = update_page_hashes(request, self.page_size)
        if index >= len(hashes) or page.page_hash != hashes[index]:
            raise ValueError(f"page {page_id} is not the cached page {index} of request "
                             f"{request.request_id!r} (stale get_computed_blocks result?)")
        return page

    def _plan_allocation(self, request: Request, num_new_tokens: int,
                         num_new_computed_tokens: int, new_computed_blocks: list[int] | None,
                         num_lookahead_tokens: int) -> _AllocationPlan:
        ps, request_id = self.page_size, request.request_id
        counts = {"num_new_tokens": num_new_tokens, "num_lookahead_tokens": num_lookahead_tokens,
                  "num_new_computed_tokens": num_new_computed_tokens}
        for name, value in counts.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if request_id in self._swapped:
            raise ValueError(f"request {request_id!r} is swapped out; swap_in first")
        table = self._tables.get(request_id, [])
        hit_ids = list(new_computed_blocks or [])
        if len(hit_ids) * ps != num_new_computed_tokens:
            raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} must equal "
                             f"{len(hit_ids)} hit pages x page_size {ps}")
        if hit_ids and (table or request.num_computed_tokens):
            raise ValueError(f"request {request_id!r}: prefix hits only on its first allocation")
        computed_pages = [self._hit_page(request, i, pid) for i, pid in enumerate(hit_ids)]
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = num_computed + num_new_tokens
        if num_tokens_after > request.num_tokens:
            raise ValueError(f"request {request_id!r} has {request.num_tokens} tokens; cannot "
                             f"schedule up to token {num_tokens_after}")
        num_slots = num_tokens_after + num_lookahead_tokens
        if self.max_model_len is not None and num_slots > self.max_model_len:
            raise ValueError(f"request {request_id!r} needs {num_slots} slots, over "
                             f"max_model_len={self.max_model_len}")
        num_required = _cdiv(num_slots, ps)
        if num_required > self.pool.num_usable_pages:
            raise ValueError(f"request {request_id!r} needs {num_required} pages; the pool "
                             f"has only {self.pool.num_usable_pages}")
        num_new_pages = max(0, num_required - len(table) - len(computed_pages))
        # NOTE: every shared page this step writes into needs a private copy first.
        last_written = _cdiv(num_tokens_after, ps) if num_new_tokens else 0
        cow_indices = [i for i in range(num_computed // ps, min(len(table), last_written))
                       if self._num_holders(table[i]) > 1]
        num_reclaimed = sum(1 for page in computed_pages if page.ref_cnt == 0)
        num_needed = num_new_pages + len(cow_indices) + num_reclaimed
        reserve = self.watermark_pages if request_id not in self._tables else 0
        fits = num_needed + reserve <= self.pool.num_allocatable_pages
        return _AllocationPlan(computed_pages, cow_indices, num_new_pages, num_computed,
                               num_tokens_after, fits)

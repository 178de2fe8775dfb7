"""Host-side KV cache manager: block tables, prefix hits, forks with copy-on-write, swap."""

from __future__ import annotations

from jaxserve.core.allocation import plan_allocation
from jaxserve.core.block_tables import BlockTables
from jaxserve.core.kv_metrics import KVCacheCounters, KVCacheStats, make_stats
from jaxserve.core.kv_page import KVPage
from jaxserve.core.page_pool import HostPool, PagePool
from jaxserve.core.plans import KVPlans, SwapPlan
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.request import Request
from jaxserve.utils import cdiv


class KVCacheManager:
    """Owns every request's block table (page ids) over one device page pool.

    Call order per step (the scheduler's side): `get_computed_pages` for a new request,
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

    Attributes:
        pool: The device page pool.
        host_pool: The host swap slots.
        tables: Every request's KV state and this step's pending moves (read it, do not
            change it from outside).
        counters: Prefix, copy-on-write and swap counters.

    Raises:
        ValueError: A size or fraction outside its range.
    """

    def __init__(self, num_pages: int, page_size: int = 16, *, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, swap_space: float = 0.0, bytes_per_page: int = 0,
                 max_model_len: int | None = None):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must lie in [0, 1), got {watermark}")
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.pool = PagePool(num_pages, enable_caching=enable_prefix_caching)
        self.host_pool = HostPool.from_swap_space(swap_space, bytes_per_page)
        self.tables = BlockTables(self.pool, self.host_pool, page_size)
        self.counters = KVCacheCounters()
        self._watermark_pages = int(watermark * self.pool.num_usable_pages)

    # ----------------------------------------------------------------- lookups
    def has_request(self, request_id: str) -> bool:
        """Whether the request holds device pages or host slots."""
        return request_id in self.tables.requests

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's KV sits in the host pool."""
        state = self.tables.requests.get(request_id)
        return state is not None and state.is_swapped

    def page_ids(self, request_id: str) -> list[int]:
        """The request's block table: its page ids in logical order.

        Raises:
            ValueError: The request is swapped out or holds nothing.
        """
        return [page.page_id for page in self.tables.on_device(request_id).pages]

    def page_delta(self, request_id: str) -> tuple[int, list[int]]:
        """What changed in the request's block table since the last call: `(start, ids)`,
        the table from index `start` on (the runner keeps the pages before it); start 0
        and the whole table the first time, after a swap-in or `resend_pages`.

        Raises:
            ValueError: The request is swapped out or holds nothing.
        """
        state = self.tables.on_device(request_id)
        start, pages = state.num_sent_pages, state.pages
        state.num_sent_pages = len(pages)
        return start, [page.page_id for page in pages[start:]]

    def resend_pages(self, request_id: str) -> None:
        """Makes the next `page_delta` the whole table (the last one never reached the
        runner: its step failed to dispatch)."""
        state = self.tables.requests.get(request_id)
        if state is not None:
            state.num_sent_pages = 0

    def take_released(self) -> list[str]:
        """Requests whose device block table was dropped (freed, swapped out) since the
        last call: the runner may forget what it kept of them."""
        return self.tables.take_released()

    @property
    def usage(self) -> float:
        """Fraction of usable pages owned by requests."""
        return self.pool.num_used_pages / self.pool.num_usable_pages

    @property
    def max_tokens_per_request(self) -> int:
        """Most tokens one request's KV can ever hold: what it gets admitted alone into
        an empty pool (every usable page less the admission watermark)."""
        return (self.pool.num_usable_pages - self._watermark_pages) * self.page_size

    # ------------------------------------------------------------- allocation
    def get_computed_pages(self, request: Request) -> tuple[list[int], int]:
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
                             "get_computed_pages is for requests without pages")
        if self.pool.prefix_cache is None:
            return [], 0
        ps = self.page_size
        hashes = update_page_hashes(request, ps)
        token_ids = request.all_token_ids
        hit_ids: list[int] = []
        for index in range((request.num_tokens - 1) // ps):
            page = self.pool.get_cached_page(hashes[index], token_ids[index * ps:(index + 1) * ps])
            if page is None:
                break
            hit_ids.append(page.page_id)
        return hit_ids, len(hit_ids) * ps

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_page_ids: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens of `request` this step.

        Takes the prefix-hit pages (first allocation only), gives a private copy of any
        shared page this step writes into (recording a copy plan when it holds computed
        tokens), appends new pages, and queues newly full pages for the prefix cache
        (indexed at `take_plans()`).

        Args:
            request: The request; `request.num_computed_tokens` is its progress so far.
            num_new_tokens: Tokens to compute this step.
            num_new_computed_tokens: Tokens covered by `new_computed_page_ids`.
            new_computed_page_ids: Page ids from `get_computed_pages`.
            num_lookahead_tokens: Extra slots to reserve (speculative tokens).

        Returns:
            Page ids newly placed in the table (copy-on-write replacements, then appended
            pages), or None when the pool is short (nothing changed; the watermark applies
            to a request's first allocation).

        Raises:
            ValueError: Negative counts, a swapped-out request, stale or mismatched hit
                pages, more tokens than the request has, or more pages than exist.
        """
        if not (num_new_computed_tokens or new_computed_page_ids or num_lookahead_tokens):
            if self._fill_in_place(request, num_new_tokens):
                return []
        plan = plan_allocation(self.tables, request, num_new_tokens, num_new_computed_tokens,
                               new_computed_page_ids, num_lookahead_tokens,
                               max_model_len=self.max_model_len,
                               watermark_pages=self._watermark_pages)
        if not plan.fits:
            return None
        state = self.tables.requests.get(request.request_id)
        if state is None:
            state = self.tables.add(request.request_id)
            if self.pool.prefix_cache is not None:
                self.counters.prefix_queries += request.num_tokens
                self.counters.prefix_hits += num_new_computed_tokens
        self.pool.touch(plan.computed_pages)
        state.pages.extend(plan.computed_pages)
        new_pages: list[KVPage] = []
        for index in plan.cow_indices:
            copy_content = index * self.page_size < plan.num_computed_tokens
            new_pages.append(self.tables.copy_on_write(state, index, copy_content))
            self.counters.num_cow_copies += int(copy_content)
        appended = self.pool.get_new_pages(plan.num_new_pages)
        state.pages.extend(appended)
        new_pages.extend(appended)
        state.num_slot_tokens = plan.num_tokens_after
        self.tables.queue_for_cache(request, plan.num_tokens_after)
        return [page.page_id for page in new_pages]

    def _fill_in_place(self, request: Request, num_new_tokens: int) -> bool:
        """Fast path of `allocate_slots` (a decode step, most of them): the new tokens fit
        the request's own unshared pages. Does what the general path would and returns
        True, or returns False (nothing changed) to take the general path."""
        state = self.tables.requests.get(request.request_id)
        if state is None or state.is_swapped or num_new_tokens < 0:
            return False
        ps, table = self.page_size, state.pages
        num_after = request.num_computed_tokens + num_new_tokens
        if num_after > len(table) * ps or num_after > request.num_tokens_with_placeholders or (
                self.max_model_len is not None and num_after > self.max_model_len):
            return False
        for index in range(request.num_computed_tokens // ps, cdiv(num_after, ps)):
            page = table[index]
            if page.ref_cnt > 1 and self.tables.num_holders(page) > 1:
                return False  # copy-on-write needed
        state.num_slot_tokens = num_after
        # NOTE: most decodes fill no page: offering nothing is what the offer would do.
        if min(num_after, request.num_tokens) // ps > state.num_cached_pages:
            self.tables.queue_for_cache(request, num_after)
        return True

    def trim(self, request: Request) -> int:
        """Frees the request's pages past its known tokens (those only rejected proposals
        were written into: speculative decoding), tail first; returns how many.

        NOTE: its slot count drops to its known tokens; the next step allocates again.
        """
        state = self.tables.requests.get(request.request_id)
        if state is None or state.is_swapped:
            return 0
        keep = cdiv(request.num_tokens_with_placeholders, self.page_size)
        extra = state.pages[keep:]
        if extra:
            del state.pages[keep:]
            state.num_sent_pages = min(state.num_sent_pages, keep)
            self.tables.release(reversed(extra))
        state.num_slot_tokens = min(state.num_slot_tokens, request.num_tokens_with_placeholders)
        return len(extra)

    # -------------------------------------------------------------- lifecycle
    def free(self, request: Request) -> None:
        """Releases a finished, aborted or recompute-preempted request's pages or slots.

        Pages go back tail first, so the request's tail is evicted before its head; cached
        pages stay reusable until evicted.

        Raises:
            ValueError: The request holds nothing (unknown or already freed).
        """
        self.tables.free(request.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        """Gives `child` the parent's pages, shared by reference count (n > 1, beams).

        Raises:
            ValueError: Unknown or swapped parent, a child that already holds KV, or a child
                whose progress or computed tokens differ from the parent's.
        """
        parent_state = self.tables.on_device(parent.request_id)
        if self.has_request(child.request_id):
            raise ValueError(f"cannot fork into {child.request_id!r}: it already holds KV")
        num_computed = parent.num_computed_tokens
        if (child.num_computed_tokens != num_computed
                or child.all_token_ids[:num_computed] != parent.all_token_ids[:num_computed]):
            raise ValueError(f"child {child.request_id!r} must match parent "
                             f"{parent.request_id!r} in computed tokens (use Request.fork)")
        self.tables.share(parent_state, child.request_id)

    # ------------------------------------------------------------------- swap
    def can_swap_out(self, request: Request) -> bool:
        """Whether `swap_out` would succeed now."""
        needed = self.tables.num_swap_out_slots(self.tables.on_device(request.request_id))
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
        if self.is_swapped(request.request_id):
            raise ValueError(f"request {request.request_id!r} is already swapped out")
        if not self.can_swap_out(request):
            self.counters.num_swap_fallbacks += 1
            return None
        pairs = self.tables.move_to_host(request)
        self.counters.num_swap_outs += 1
        self.counters.num_swapped_out_pages += len(pairs)
        return SwapPlan(pairs, to_host=True)

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Whether `swap_in` would succeed now (watermark included), and the free pages
        would also cover the request's next `num_new_tokens` tokens.

        Raises:
            ValueError: The request is not swapped out.
        """
        slot_ids = self.tables.swapped_out(request.request_id).host_slot_ids
        num_free = self.pool.num_allocatable_pages
        return (len(slot_ids) + self._watermark_pages <= num_free and
                cdiv(request.num_computed_tokens + num_new_tokens, self.page_size) <= num_free)

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
        pairs = self.tables.move_to_device(request)
        self.counters.num_swap_ins += 1
        self.counters.num_swapped_in_pages += len(pairs)
        return SwapPlan(pairs, to_host=False)

    # ---------------------------------------------------------- step / metrics
    def take_plans(self) -> KVPlans:
        """Drains this step's swap and copy plans for the runner; call once per step.

        NOTE: only now are copy sources unpinned and swap-in host slots reusable, because
        only now has the runner been handed the moves that read them. Pages filled this
        step join the prefix cache now too, not at allocation: a request freed or swapped
        out later in the same scheduling pass never computes its pages, and nobody may
        have hit them meanwhile.
        """
        return self.tables.take()

    def evict_cached_pages(self, max_num_pages: int | None = None) -> int:
        """Forgets up to `max_num_pages` unowned cached pages (all if None), LRU first."""
        return self.pool.evict_cached_pages(max_num_pages)

    def stats(self) -> KVCacheStats:
        """A snapshot of usage, fragmentation, prefix, copy-on-write and swap figures."""
        num_allocated, num_token_slots = self.tables.count_token_slots()
        return make_stats(
            num_total_pages=self.pool.num_usable_pages,
            num_cached_pages=self.pool.num_cached_free_pages,
            num_used_pages=self.pool.num_used_pages,
            num_allocated_slots=num_allocated, num_token_slots=num_token_slots,
            num_total_host_slots=self.host_pool.num_slots,
            num_free_host_slots=self.host_pool.num_free_slots, counters=self.counters)

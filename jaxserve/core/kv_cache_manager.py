"""Host-side KV cache manager: block tables, prefix hits, forks with copy-on-write, swap."""

from __future__ import annotations

from jaxserve.core.allocation import plan_allocation
from jaxserve.core.block_tables import BlockTables
from jaxserve.core.group_hits import find_group_hits
from jaxserve.core.kv_fork import KVForker
from jaxserve.core.kv_metrics import KVCacheCounters, KVCacheStats, make_stats
from jaxserve.core.kv_page import KVPage, group_key
from jaxserve.core.kv_swap import KVSwapper
from jaxserve.core.page_pool import HostPool, PagePool
from jaxserve.core.plans import KVPlans
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.core.state_slots import NULL_STATE_SLOT, StateGroupSpec, StateSlots
from jaxserve.core.state_snapshots import StateSnapshots, build_state_group
from jaxserve.request import Request
from jaxserve.utils import cdiv, delegated


class KVCacheManager:
    """Owns every request's block table (page ids) over one device page pool.

    Swap preemption (`can_swap_out`, `swap_out`, `can_swap_in`, `swap_in`) is its
    `swapper`'s (`KVSwapper`), forks (`fork`, `can_fork`) its `forker`'s (`KVForker`).
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
        group_windows: Per KV cache group (`models.kv_groups`), its sliding window (0: full
            attention). Every group has a block table per request and takes page ids
            from the one pool; a sliding group's pages outside every query's window go
            back while the request runs.
        max_chunk_tokens: Most tokens one step computes for a request (the step budget):
            bounds what a sliding group holds at once (None: no bound).
        state_group: A model with linear-attention layers (`StateGroupSpec`): every request
            also holds one state slot, from its first allocation until it is freed (host
            slots while swapped out; forks copy it). None: no state group (no cost). Prefix
            caching then needs its snapshot slots (`StateGroupSpec.num_snapshot_slots`).

    Attributes:
        pool: The device page pool.
        host_pool: The host swap slots.
        state_slots: The state group's slots (`StateSlots`), or None.
        snapshots: The state group's prefix-caching snapshots (`StateSnapshots`), or None.
        prefix_caching_disabled_reason: Why prefix caching is off although it was asked
            for (for the startup log and `/metrics`), or None.
        tables: Every request's KV state and this step's pending moves (read it, do not
            change it from outside).
        counters: Prefix, copy-on-write and swap counters.

    Raises:
        ValueError: A size or fraction outside its range.
    """

    def __init__(self, num_pages: int, page_size: int = 16, *, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, swap_space: float = 0.0, bytes_per_page: int = 0,
                 max_model_len: int | None = None, group_windows: tuple[int, ...] = (0,),
                 max_chunk_tokens: int | None = None, state_group: StateGroupSpec | None = None):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must lie in [0, 1), got {watermark}")
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if not group_windows:
            raise ValueError(f"group_windows must list one window per KV cache group (0 full, "
                             f"> 0 sliding, -C chunks of C), got {group_windows}")
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.group_windows = tuple(group_windows)
        self.max_chunk_tokens = max_chunk_tokens
        self.state_slots: StateSlots | None = None
        self.snapshots: StateSnapshots | None = None
        self.prefix_caching_disabled_reason: str | None = None
        if state_group is not None:
            self.state_slots, self.snapshots, self.prefix_caching_disabled_reason = (
                build_state_group(state_group, swap_space, enable_prefix_caching, page_size))
            enable_prefix_caching = enable_prefix_caching and self.snapshots is not None
        self.pool = PagePool(num_pages, enable_caching=enable_prefix_caching)
        self.host_pool = HostPool.from_swap_space(swap_space, bytes_per_page)
        self.tables = BlockTables(self.pool, self.host_pool, page_size, self.group_windows)
        self.counters = KVCacheCounters()
        self._watermark_pages = int(watermark * self.pool.num_usable_pages)
        self.swapper = KVSwapper(self.tables, self.counters, self._watermark_pages,
                                 self.state_slots)
        self.forker = KVForker(self.tables, self.state_slots)

    fork = delegated("forker", KVForker.fork)
    can_fork = delegated("forker", KVForker.can_fork)
    can_swap_out = delegated("swapper", KVSwapper.can_swap_out)
    swap_out = delegated("swapper", KVSwapper.swap_out)
    can_swap_in = delegated("swapper", KVSwapper.can_swap_in)
    swap_in = delegated("swapper", KVSwapper.swap_in)

    # NOTE: one pool, one attention rank; `RankedKVCacheManager` splits it into several.
    num_ranks = 1  # attention ranks (data-parallel attention)

    # ----------------------------------------------------------------- lookups
    def rank_of(self, request_id: str) -> int:
        """The request's attention rank: always 0 (`RankedKVCacheManager` has several)."""
        return 0

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds device pages or host slots."""
        return request_id in self.tables.requests

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's KV sits in the host pool."""
        return self.tables.is_swapped(request_id)

    def state_slot(self, request_id: str) -> int:
        """The request's device state slot (the row of the state pools its step reads and
        writes: `AttentionMetadata.state_slots`); 0 without a state group.

        Raises:
            ValueError: With a state group, the request holds no device slot.
        """
        slots = self.state_slots
        return NULL_STATE_SLOT if slots is None else slots.slot(request_id)

    @property
    def num_groups(self) -> int:
        """KV cache groups (block tables per request)."""
        return len(self.group_windows)

    def page_ids(self, request_id: str, group: int = 0) -> list[int]:
        """A block table of the request: its page ids in logical order (0: a sliding
        group's page given back).

        Raises:
            ValueError: The request is swapped out or holds nothing.
        """
        return [page.page_id for page in self.tables.on_device(request_id).tables[group]]

    def page_delta(self, request_id: str) -> tuple[int, list[int]]:
        """Group 0's part of `page_deltas` (the whole of it with one group)."""
        return self._delta(self.tables.on_device(request_id), 0)

    def page_deltas(self, request_id: str) -> list[tuple[int, list[int]]]:
        """What changed in each group's block table since the last call: `(start, ids)`,
        the table from index `start` on (the runner keeps the pages before it); start 0
        and the whole table the first time, after a swap-in or `resend_pages`.

        Raises:
            ValueError: The request is swapped out or holds nothing.
        """
        state = self.tables.on_device(request_id)
        return [self._delta(state, g) for g in range(self.num_groups)]

    @staticmethod
    def _delta(state, group: int) -> tuple[int, list[int]]:
        start, table = state.num_sent_pages[group], state.tables[group]
        state.num_sent_pages[group] = len(table)
        return start, [page.page_id for page in table[start:]]

    def resend_pages(self, request_id: str) -> None:
        """Makes the next `page_deltas` the whole tables (the last ones never reached the
        runner: its step failed to dispatch)."""
        state = self.tables.requests.get(request_id)
        if state is not None:
            state.resend()
        if self.snapshots is not None:  # NOTE: also its state never reached a snapshot
            self.snapshots.cancel_step(request_id)

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
        an empty pool (every usable page less the admission watermark), counting every
        group's pages at the worst step (`pages_for_tokens`)."""
        budget = self.pool.num_usable_pages - self._watermark_pages
        if len(self.group_windows) == 1 and not self.group_windows[0]:
            return budget * self.page_size
        lo, hi = 0, self.max_model_len or budget * self.page_size * len(self.group_windows)
        while lo < hi:  # the largest n with pages_for_tokens(n) <= budget
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.pages_for_tokens(mid) <= budget else (lo, mid - 1)
        return lo

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Most pages a request of `num_tokens` tokens holds at once, over all groups: a
        sliding group holds its window plus the step's new tokens (`max_chunk_tokens`)."""
        n = cdiv(num_tokens, self.page_size)
        chunk = self.max_chunk_tokens or num_tokens
        # NOTE: a chunked group (w = -C) holds at most C - 1 earlier tokens too.
        return sum(n if not w else min(n, cdiv(abs(w) - 1 + chunk, self.page_size) + 1)
                   for w in self.group_windows)

    # ------------------------------------------------------------- allocation
    def get_computed_pages(self, request: Request) -> tuple[list[int] | tuple[list[int], ...], int]:
        """Looks up cached pages for a request's leading full pages.

        The hit stops before the page holding the last token, so at least that token is
        computed (its logits are needed). With several KV cache groups it is the longest
        prefix every group serves (`group_hits.find_group_hits`). The query is counted
        when the request's first `allocate_slots` succeeds, so a request that waits and
        looks up again each step counts once.

        Returns:
            (page ids of the hit, number of tokens they hold); with several groups the
            ids are a tuple of one list per group (0 where a sliding group's window
            does not reach).

        Raises:
            ValueError: The request already holds pages or is swapped out.
        """
        if self.has_request(request.request_id):
            raise ValueError(f"request {request.request_id!r} already holds KV; "
                             "get_computed_pages is for requests without pages")
        empty = [] if self.num_groups == 1 else tuple([] for _ in self.group_windows)
        if self.pool.prefix_cache is None:
            return empty, 0
        ps = self.page_size
        hashes = update_page_hashes(request, ps)
        token_ids = request.all_token_ids

        def lookup(group: int, index: int):
            return self.pool.get_cached_page(group_key(hashes[index], group),
                                             token_ids[index * ps:(index + 1) * ps])

        # NOTE: with a state group a hit also needs a snapshot of its prefix's state.
        bound = None if self.snapshots is None else lambda k: self.snapshots.longest(hashes, k)
        num_pages, pages = find_group_hits(lookup, self.group_windows,
                                           (request.num_tokens - 1) // ps, ps, bound)
        ids = [[0 if page is None else page.page_id for page in group] for group in pages]
        return (ids[0] if self.num_groups == 1 else tuple(ids)), num_pages * ps

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_page_ids: list[int] | tuple[list[int], ...] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens of `request` this step.

        Gives back sliding groups' pages outside the window, takes the prefix-hit pages
        (first allocation only), gives a private copy of any shared page this step writes
        into (recording a copy plan when it holds computed tokens), appends new pages to
        every group's table, and queues newly full pages for the prefix cache (indexed at
        `take_plans()`).

        Args:
            request: The request; `request.num_computed_tokens` is its progress so far.
            num_new_tokens: Tokens to compute this step.
            num_new_computed_tokens: Tokens covered by `new_computed_page_ids`.
            new_computed_page_ids: Page ids from `get_computed_pages` (as it returns them).
            num_lookahead_tokens: Extra slots to reserve (speculative tokens).

        Returns:
            Page ids newly placed in the table (copy-on-write replacements, then appended
            pages), or None when the pool is short, or with a state group no state slot is
            free for a request's first allocation (nothing changed; the watermark applies
            to a request's first allocation).

        Raises:
            ValueError: Negative counts, a swapped-out request, stale or mismatched hit
                pages, more tokens than the request has, or more pages than exist.
        """
        hits = new_computed_page_ids
        if not (num_new_computed_tokens or hits or num_lookahead_tokens):
            if self._fill_in_place(request, num_new_tokens):
                return []
        state = self.tables.requests.get(request.request_id)
        drops = self.tables.device_state(request.request_id) is not None and bool(
            self.tables.sliding)
        num_freed = (self.tables.num_freed_outside_window(state, request.num_computed_tokens)
                     if drops else 0)
        if not hits:
            hits = [[] for _ in self.group_windows]
        elif self.num_groups == 1 and not isinstance(hits, tuple):
            hits = [hits]
        plan = plan_allocation(self.tables, request, num_new_tokens, num_new_computed_tokens,
                               list(hits), num_lookahead_tokens,
                               max_model_len=self.max_model_len,
                               watermark_pages=self._watermark_pages, num_freed=num_freed)
        if not plan.fits or (state is None and self.state_slots is not None
                             and not self.state_slots.num_free_slots):
            return None
        copy_from = None  # NOTE: looked up before anything changes, as it may raise
        if state is None and num_new_computed_tokens and self.snapshots is not None:
            copy_from = self.snapshots.source(request, num_new_computed_tokens)
        if drops:
            self.tables.drop_outside_window(state, request.num_computed_tokens)
        if state is None:
            state = self.tables.add(request.request_id)
            if self.state_slots is not None:
                self.state_slots.allocate(request.request_id, copy_from)
            if self.pool.prefix_cache is not None:
                self.counters.prefix_queries += request.num_tokens
                self.counters.prefix_hits += num_new_computed_tokens
        for g, pages in enumerate(plan.computed_pages):
            self.pool.touch(page for page in pages if not page.is_null)
            state.tables[g].extend(pages)
            state.num_dropped[g] = sum(1 for page in pages if page.is_null)
        new_pages: list[KVPage] = []
        for g, index in plan.cow:
            copy_content = index * self.page_size < plan.num_computed_tokens
            new_pages.append(self.tables.copy_on_write(state, g, index, copy_content))
            self.counters.num_cow_copies += int(copy_content)
        for table in state.tables:
            appended = self.pool.get_new_pages(plan.num_new_pages)
            table.extend(appended)
            new_pages.extend(appended)
        state.num_slot_tokens = plan.num_tokens_after
        self.tables.queue_for_cache(request, plan.num_tokens_after)
        if self.snapshots is not None and not num_lookahead_tokens:
            self.snapshots.note_step(request, plan.num_tokens_after)
        return [page.page_id for page in new_pages]

    def _fill_in_place(self, request: Request, num_new_tokens: int) -> bool:
        """Fast path of `allocate_slots` (a decode step, most of them): the new tokens fit
        the request's own unshared pages. Does what the general path would and returns
        True, or returns False (nothing changed) to take the general path."""
        state = self.tables.device_state(request.request_id)
        if state is None or num_new_tokens < 0:
            return False
        ps, tables = self.page_size, state.tables
        num_after = request.num_computed_tokens + num_new_tokens
        if num_after > len(tables[0]) * ps or num_after > request.num_tokens_with_placeholders or (
                self.max_model_len is not None and num_after > self.max_model_len):
            return False
        for table in tables:
            for index in range(request.num_computed_tokens // ps, cdiv(num_after, ps)):
                page = table[index]
                if page.ref_cnt > 1 and self.tables.num_holders(page) > 1:
                    return False  # copy-on-write needed
        if self.tables.sliding:
            self.tables.drop_outside_window(state, request.num_computed_tokens)
        state.num_slot_tokens = num_after
        if self.snapshots is not None:
            self.snapshots.note_step(request, num_after)
        # NOTE: most decodes fill no page: offering nothing is what the offer would do.
        if min(num_after, request.num_tokens) // ps > state.num_cached_pages:
            self.tables.queue_for_cache(request, num_after)
        return True

    def trim(self, request: Request) -> int:
        """Frees the request's pages past its known tokens (those only rejected proposals
        were written into: speculative decoding), tail first; returns how many.

        NOTE: its slot count drops to its known tokens; the next step allocates again.
        """
        state = self.tables.device_state(request.request_id)
        if state is None:
            return 0
        keep = cdiv(request.num_tokens_with_placeholders, self.page_size)
        num_trimmed = 0
        for g, table in enumerate(state.tables):
            extra = [page for page in reversed(table[keep:]) if not page.is_null]
            if len(table) > keep:
                del table[keep:]
                state.num_sent_pages[g] = min(state.num_sent_pages[g], keep)
                self.tables.release(extra)
            num_trimmed += len(extra)
        state.num_slot_tokens = min(state.num_slot_tokens, request.num_tokens_with_placeholders)
        return num_trimmed

    # -------------------------------------------------------------- lifecycle
    def free(self, request: Request) -> None:
        """Releases a finished, aborted or recompute-preempted request's pages or slots.

        Pages go back tail first, so the request's tail is evicted before its head; cached
        pages stay reusable until evicted.

        Raises:
            ValueError: The request holds nothing (unknown or already freed).
        """
        self.tables.free(request.request_id)
        if self.state_slots is not None:
            self.state_slots.free(request.request_id)

    # ---------------------------------------------------------- step / metrics
    def take_plans(self) -> KVPlans:
        """Drains this step's swap and copy plans for the runner; call once per step.

        NOTE: only now are copy sources unpinned and swap-in host slots reusable, because
        only now has the runner been handed the moves that read them. Pages filled this
        step join the prefix cache now too, not at allocation: a request freed or swapped
        out later in the same scheduling pass never computes its pages, and nobody may
        have hit them meanwhile.
        """
        plans = self.tables.take()
        if self.state_slots is not None:
            plans.state = self.state_slots.take()
        if self.snapshots is not None:
            plans.state.copy.pairs += self.snapshots.take(self.state_slots.slot)
        return plans

    def evict_cached_pages(self, max_num_pages: int | None = None) -> int:
        """Forgets up to `max_num_pages` unowned cached pages (all if None, and then every
        state snapshot too), LRU first."""
        if max_num_pages is None and self.snapshots is not None:
            self.snapshots.clear()
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

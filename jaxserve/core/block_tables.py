"""Every request's KV state in one object (`RequestKV`), and the tables that hold them all."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxserve.core.group_hits import first_key
from jaxserve.core.kv_metrics import count_token_slots
from jaxserve.core.kv_page import KVPage, group_key
from jaxserve.core.page_pool import HostPool, PagePool
from jaxserve.core.plans import KVPlans, PendingPlans
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.request import Request
from jaxserve.utils import cdiv


@dataclass
class RequestKV:
    """What the KV cache keeps for one request, in device pages or swapped out to host slots.

    With a hybrid KV cache each group of layers has its own block table; entries of a
    sliding-window group that fell out of the window hold the null page.

    Attributes:
        tables: Per group, the block table: device pages in logical order (empty while
            swapped out).
        host_tables: Per group, host slots in logical order while swapped out (-1 where
            the table held the null page); None on device.
        num_slot_tokens: Tokens the request keeps in its pages (computed or being computed).
        num_cached_pages: Leading pages already offered to the prefix cache; while swapped
            out, those to offer again at swap-in.
        num_sent_pages: Per group, leading pages the runner holds as they are in its
            persistent row of this request (`KVCacheManager.page_deltas`); a change at a
            lower index lowers it, so the next delta starts there.
        num_dropped: Per group, leading entries given back (outside the group's window).
    """

    tables: list[list[KVPage]] = field(default_factory=lambda: [[]])
    host_tables: list[list[int]] | None = None
    num_slot_tokens: int = 0
    num_cached_pages: int = 0
    num_sent_pages: list[int] = field(default_factory=lambda: [0])
    num_dropped: list[int] = field(default_factory=lambda: [0])

    @classmethod
    def empty(cls, num_groups: int) -> RequestKV:
        """A state holding nothing, for `num_groups` groups."""
        return cls([[] for _ in range(num_groups)], num_sent_pages=[0] * num_groups,
                   num_dropped=[0] * num_groups)

    @property
    def pages(self) -> list[KVPage]:
        """Group 0's block table (the only one without a hybrid KV cache)."""
        return self.tables[0]

    @property
    def host_slot_ids(self) -> list[int] | None:
        """Every host slot the request holds while swapped out (all groups); None on device."""
        if self.host_tables is None:
            return None
        return [slot for table in self.host_tables for slot in table if slot >= 0]

    @property
    def is_swapped(self) -> bool:
        """Whether the request's KV sits in host slots."""
        return self.host_tables is not None

    def owned_pages(self) -> list[KVPage]:
        """Every non-null page of every group, each table tail first (release order)."""
        return [page for table in self.tables for page in reversed(table) if not page.is_null]

    def resend(self) -> None:
        """Makes the next delta of every group the whole table."""
        self.num_sent_pages = [0] * len(self.tables)


class BlockTables:
    """Every request's `RequestKV` over the device and host pools, and this step's moves.

    The mechanism `KVCacheManager` composes: it finds, adds and drops requests' state,
    releases pages, gives back pages outside a sliding group's window, moves a request
    between device pages and host slots, and offers full pages to the prefix cache.
    Whether something may happen (limits, watermark, free slots) is the manager's
    decision, taken before it calls in here.

    Args:
        pool: The device page pool.
        host_pool: The host swap slots.
        page_size: Token slots per page.
        windows: Per KV cache group, its sliding window (0: full attention).
    """

    def __init__(self, pool: PagePool, host_pool: HostPool, page_size: int,
                 windows: tuple[int, ...] = (0,)):
        self.pool = pool
        self.host_pool = host_pool
        self.page_size = page_size
        self.windows = tuple(windows)
        # Groups that give pages back: sliding windows (w > 0) and chunks (w = -C).
        self.sliding = [g for g, w in enumerate(self.windows) if w != 0]
        self.pending = PendingPlans()
        self.requests: dict[str, RequestKV] = {}
        # This step's prefix-cache offers, in the order first queued (of two pages with
        # equal content, the first offered is indexed): request id -> (request, tokens its
        # pages will hold). Dropped with the request's device pages.
        self._offers: dict[str, tuple[Request, int]] = {}
        # Requests whose device block table was dropped (freed, swapped out) since the
        # last `take_released()`: the runner may forget its rows of them.
        self._released: list[str] = []

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    # ----------------------------------------------------------------- lookups
    def device_state(self, request_id: str) -> RequestKV | None:
        """The state of a request holding device pages, or None (no pages, or swapped out)."""
        state = self.requests.get(request_id)
        return None if state is None or state.is_swapped else state

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's KV sits in the host pool."""
        state = self.requests.get(request_id)
        return state is not None and state.is_swapped

    def on_device(self, request_id: str) -> RequestKV:
        """The state of a request holding device pages.

        Raises:
            ValueError: The request is swapped out or holds nothing.
        """
        state = self.requests.get(request_id)
        if state is None or state.is_swapped:
            what = "holds no pages" if state is None else "is swapped out"
            raise ValueError(f"request {request_id!r} {what}")
        return state

    def swapped_out(self, request_id: str) -> RequestKV:
        """The state of a swapped-out request. Raises ValueError if it is not swapped out."""
        state = self.requests.get(request_id)
        if state is None or not state.is_swapped:
            raise ValueError(f"request {request_id!r} is not swapped out")
        return state

    def num_holders(self, page: KVPage) -> int:
        """Block tables holding `page` (its ref count less pending copies' pins)."""
        return page.ref_cnt - self.pending.num_pins(page.page_id)

    def count_token_slots(self) -> tuple[int, int]:
        """(allocated slots, slots holding a token) over the distinct pages of all tables."""
        return count_token_slots(
            (([page.page_id for page in table], state.num_slot_tokens)
             for state in self.requests.values() for table in state.tables), self.page_size)

    # --------------------------------------------------------------- lifecycle
    def add(self, request_id: str) -> RequestKV:
        """Starts empty block tables for a request that holds nothing yet."""
        state = self.requests[request_id] = RequestKV.empty(self.num_groups)
        return state

    def share(self, parent: RequestKV, child_id: str, num_tokens: int | None = None) -> None:
        """Gives `child_id` the parent's pages (one more owner each) and progress: all of
        them, or only those holding its first `num_tokens` tokens (`can_share`)."""
        state = RequestKV([list(table) for table in parent.tables],
                          num_slot_tokens=parent.num_slot_tokens,
                          num_cached_pages=parent.num_cached_pages,
                          num_sent_pages=[0] * self.num_groups,
                          num_dropped=list(parent.num_dropped))
        if num_tokens is not None and num_tokens < parent.num_slot_tokens:
            n = cdiv(num_tokens, self.page_size)
            state.tables = [table[:n] for table in state.tables]
            state.num_slot_tokens = num_tokens
            state.num_cached_pages = min(state.num_cached_pages, num_tokens // self.page_size)
            state.num_dropped = [min(d, n) for d in state.num_dropped]
        self.pool.touch(state.owned_pages())
        self.requests[child_id] = state

    def can_share(self, parent: RequestKV, num_tokens: int) -> bool:
        """Whether a request computed up to `num_tokens` of the parent's tokens can take
        the parent's pages for them: every sliding group still holds the pages its window
        reads from there on (the parent, further on, may have given back pages that a
        shorter request still reads)."""
        return all(parent.num_dropped[g] <= first_key(num_tokens, self.windows[g])
                   // self.page_size for g in self.sliding)

    def free(self, request_id: str) -> None:
        """Drops a request's state, returning its pages (tail first) or its host slots.

        Raises:
            ValueError: The request holds nothing.
        """
        state = self.requests.pop(request_id, None)
        if state is None:
            raise ValueError(f"request {request_id!r} holds no pages")
        self._offers.pop(request_id, None)
        if state.is_swapped:
            self.pending.drop_swap_out_slots(state.host_slot_ids)
            self.host_pool.free(state.host_slot_ids)
        else:
            self._released.append(request_id)
            self.release(state.owned_pages())

    def take_released(self) -> list[str]:
        """Requests whose device block table was dropped since the last call."""
        released, self._released = self._released, []
        return released

    def release(self, ordered_pages: Iterable[KVPage]) -> None:
        """Drops one owner from each page, forgetting pending moves into unowned ones."""
        for page in self.pool.free_pages(ordered_pages):
            self.pending.drop_page(page.page_id)

    def _outside_window(self, state: RequestKV, num_computed_tokens: int):
        """(group, start, end) of each sliding group's entries `drop_outside_window` drops."""
        for g in self.sliding:
            first_needed = first_key(num_computed_tokens, self.windows[g]) // self.page_size
            start, end = state.num_dropped[g], min(first_needed, len(state.tables[g]))
            if end > start:
                yield g, start, end

    def num_dropped_after(self, state: RequestKV, num_computed_tokens: int) -> list[int]:
        """Per group, `state.num_dropped` once `drop_outside_window` has run."""
        dropped = list(state.num_dropped)
        for g, _, end in self._outside_window(state, num_computed_tokens):
            dropped[g] = end
        return dropped

    def num_freed_outside_window(self, state: RequestKV, num_computed_tokens: int) -> int:
        """Pages `drop_outside_window` would return to the pool (those no one else holds)."""
        return sum(1 for g, start, end in self._outside_window(state, num_computed_tokens)
                   for page in state.tables[g][start:end]
                   if not page.is_null and page.ref_cnt == 1)

    def drop_outside_window(self, state: RequestKV, num_computed_tokens: int) -> int:
        """Gives back the sliding groups' pages no later query can see; returns how many.

        The next query sits at position `num_computed_tokens` (positions only grow until
        the request is freed), and a window-w layer reads keys from p - w + 1 on; pages
        wholly before that hold nothing any step will read. Their entries become the
        null page; cached ones stay in the prefix cache until evicted.
        """
        num_freed = 0
        for g, start, end in list(self._outside_window(state, num_computed_tokens)):
            table = state.tables[g]
            dropped = [page for page in table[start:end] if not page.is_null]
            table[start:end] = [self.pool.null_page] * (end - start)
            state.num_dropped[g] = end
            state.num_sent_pages[g] = min(state.num_sent_pages[g], start)
            self.release(reversed(dropped))
            num_freed += len(dropped)
        return num_freed

    def copy_on_write(self, state: RequestKV, group: int, index: int,
                      copy_content: bool) -> KVPage:
        """Puts a fresh private page at `index` of a group's table in place of a shared one.

        Args:
            state: The request's state.
            group: The KV cache group.
            index: The table index of the shared page.
            copy_content: Whether the page holds computed tokens, so a copy from it is
                planned (its source pinned until `take()`).

        Returns:
            The new page.
        """
        table = state.tables[group]
        old = table[index]
        (page,) = self.pool.get_new_pages(1)
        if copy_content:
            src_id = self.pending.resolve_copy_src(old.page_id)
            self.pool.touch([self.pool.pages[src_id]])
            self.pending.add_copy(src_id, page.page_id)
        table[index] = page
        state.num_sent_pages[group] = min(state.num_sent_pages[group], index)
        self.release([old])
        return page

    # -------------------------------------------------------------------- swap
    def num_swap_out_slots(self, state: RequestKV) -> int | None:
        """Host slots a swap-out needs, or None if a page's content is still in flight."""
        needed = 0
        for page in state.owned_pages():
            if page.page_id in self.pending.swap_in_src:
                if page.ref_cnt != 1:
                    return None  # NOTE: shared or pinned mid-swap-in; recompute instead.
            elif self.pending.resolve_copy_src(page.page_id) in self.pending.swap_in_src:
                # NOTE: a copy of a page still arriving from the host: swap-out would run
                # before that swap-in and read nothing.
                return None
            else:
                needed += 1
        return needed

    def move_to_host(self, request: Request) -> list[tuple[int, int]]:
        """Swaps a request out: plans its pages' moves to host slots and frees the pages.

        The caller has checked `num_swap_out_slots` against the free host slots. Null
        entries (outside a window) stay null: they take no slot.

        Returns:
            The (device page, host slot) pairs planned.
        """
        state = self.requests[request.request_id]
        fresh_slots = iter(self.host_pool.allocate(self.num_swap_out_slots(state)))
        pairs: list[tuple[int, int]] = []
        host_tables: list[list[int]] = []
        for table in state.tables:
            slots = []
            for page in table:
                if page.is_null:
                    slots.append(-1)
                elif page.page_id in self.pending.swap_in_src:
                    # NOTE: swapped in this very step: the host slot still holds the content.
                    slots.append(self.pending.reclaim_swap_in(page.page_id))
                else:
                    slot = next(fresh_slots)
                    pairs.append((self.pending.resolve_copy_src(page.page_id), slot))
                    slots.append(slot)
            host_tables.append(slots)
        self.pending.swap_out_pairs.extend(pairs)
        # NOTE: swap-in re-offers these pages to the prefix cache; never pages past the
        # computed tokens, whose KV the host copy does not hold.
        state.num_cached_pages = min(state.num_cached_pages,
                                     request.num_computed_tokens // self.page_size)
        owned = state.owned_pages()
        state.tables, state.host_tables = [[] for _ in state.tables], host_tables
        state.resend()
        self._offers.pop(request.request_id, None)
        self._released.append(request.request_id)
        self.release(owned)
        return pairs

    def move_to_device(self, request: Request) -> list[tuple[int, int]]:
        """Swaps a request in: fresh device pages in the same logical order as its slots.

        The caller has checked that the pool has the pages.

        Returns:
            The (host slot, device page) pairs planned.
        """
        state = self.requests[request.request_id]
        host_tables = state.host_tables
        fresh = iter(self.pool.get_new_pages(len(state.host_slot_ids)))
        pairs: list[tuple[int, int]] = []
        tables: list[list[KVPage]] = []
        for slots in host_tables:
            table = []
            for slot in slots:
                if slot < 0:
                    table.append(self.pool.null_page)
                    continue
                page = next(fresh)
                self.pending.add_swap_in(slot, page.page_id)
                pairs.append((slot, page.page_id))
                table.append(page)
            tables.append(table)
        num_to_offer = state.num_cached_pages
        state.tables, state.host_tables, state.num_cached_pages = tables, None, 0
        self.queue_for_cache(request, num_to_offer * self.page_size)
        return pairs

    # ------------------------------------------------------ prefix cache, step
    def queue_for_cache(self, request: Request, num_tokens: int) -> None:
        """Queues the request's pages covering `num_tokens` for the prefix cache at `take()`.

        Only known tokens count: a slot reserved for a token still in flight (async
        scheduling) joins the cache at a later allocation, once the token is known.
        """
        if self.pool.prefix_cache is not None:
            self._offers[request.request_id] = (request, min(num_tokens, request.num_tokens))

    def take(self) -> KVPlans:
        """Offers queued full pages to the prefix cache, then drains this step's moves."""
        for request_id, (request, num_tokens) in self._offers.items():
            self._offer_full_pages(self.requests[request_id], request, num_tokens)
        self._offers.clear()
        plans, pinned_ids, deferred_slot_ids = self.pending.take()
        self.pool.free_pages(self.pool.pages[page_id] for page_id in pinned_ids)
        self.host_pool.free(deferred_slot_ids)
        return plans

    def _offer_full_pages(self, state: RequestKV, request: Request, num_tokens: int) -> None:
        """Offers the request's newly full pages (covering `num_tokens`) in every group."""
        ps = self.page_size
        start = state.num_cached_pages
        num_full = min(num_tokens // ps, len(state.tables[0]))
        if num_full <= start:
            return
        hashes = update_page_hashes(request, ps)
        token_ids = request.all_token_ids
        for index in range(start, num_full):
            page_tokens = token_ids[index * ps:(index + 1) * ps]
            for g, table in enumerate(state.tables):
                if not table[index].is_null:
                    self.pool.cache_full_page(table[index], group_key(hashes[index], g),
                                              page_tokens)
        state.num_cached_pages = num_full

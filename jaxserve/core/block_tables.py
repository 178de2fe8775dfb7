"""Every request's KV state in one object (`RequestKV`), and the tables that hold them all."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxserve.core.kv_metrics import count_token_slots
from jaxserve.core.kv_page import KVPage
from jaxserve.core.page_pool import HostPool, PagePool
from jaxserve.core.plans import KVPlans, PendingPlans
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.request import Request


@dataclass
class RequestKV:
    """What the KV cache keeps for one request, in device pages or swapped out to host slots.

    Attributes:
        pages: The block table: device pages in logical order (empty while swapped out).
        host_slot_ids: Host slots in logical order while swapped out; None on device.
        num_slot_tokens: Tokens the request keeps in its pages (computed or being computed).
        num_cached_pages: Leading pages already offered to the prefix cache; while swapped
            out, those to offer again at swap-in.
        num_sent_pages: Leading pages the runner holds as they are in its persistent row
            of this request (`KVCacheManager.page_delta`); a change at a lower index
            lowers it, so the next delta starts there.
    """

    pages: list[KVPage] = field(default_factory=list)
    host_slot_ids: list[int] | None = None
    num_slot_tokens: int = 0
    num_cached_pages: int = 0
    num_sent_pages: int = 0

    @property
    def is_swapped(self) -> bool:
        """Whether the request's KV sits in host slots."""
        return self.host_slot_ids is not None


class BlockTables:
    """Every request's `RequestKV` over the device and host pools, and this step's moves.

    The mechanism `KVCacheManager` composes: it finds, adds and drops requests' state,
    releases pages, moves a request between device pages and host slots, and offers full
    pages to the prefix cache. Whether something may happen (limits, watermark, free
    slots) is the manager's decision, taken before it calls in here.

    Args:
        pool: The device page pool.
        host_pool: The host swap slots.
        page_size: Token slots per page.
    """

    def __init__(self, pool: PagePool, host_pool: HostPool, page_size: int):
        self.pool = pool
        self.host_pool = host_pool
        self.page_size = page_size
        self.pending = PendingPlans()
        self.requests: dict[str, RequestKV] = {}
        # This step's prefix-cache offers, in the order first queued (of two pages with
        # equal content, the first offered is indexed): request id -> (request, tokens its
        # pages will hold). Dropped with the request's device pages.
        self._offers: dict[str, tuple[Request, int]] = {}
        # Requests whose device block table was dropped (freed, swapped out) since the
        # last `take_released()`: the runner may forget its rows of them.
        self._released: list[str] = []

    # ----------------------------------------------------------------- lookups
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
            (([page.page_id for page in state.pages], state.num_slot_tokens)
             for state in self.requests.values()), self.page_size)

    # --------------------------------------------------------------- lifecycle
    def add(self, request_id: str) -> RequestKV:
        """Starts an empty block table for a request that holds nothing yet."""
        state = self.requests[request_id] = RequestKV()
        return state

    def share(self, parent: RequestKV, child_id: str) -> None:
        """Gives `child_id` the parent's pages (one more owner each) and progress."""
        self.pool.touch(parent.pages)
        self.requests[child_id] = RequestKV(
            list(parent.pages), num_slot_tokens=parent.num_slot_tokens,
            num_cached_pages=parent.num_cached_pages)

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
            self.release(reversed(state.pages))

    def take_released(self) -> list[str]:
        """Requests whose device block table was dropped since the last call."""
        released, self._released = self._released, []
        return released

    def release(self, ordered_pages: Iterable[KVPage]) -> None:
        """Drops one owner from each page, forgetting pending moves into unowned ones."""
        for page in self.pool.free_pages(ordered_pages):
            self.pending.drop_page(page.page_id)

    def copy_on_write(self, state: RequestKV, index: int, copy_content: bool) -> KVPage:
        """Puts a fresh private page at `index` of the table in place of a shared one.

        Args:
            state: The request's state.
            index: The table index of the shared page.
            copy_content: Whether the page holds computed tokens, so a copy from it is
                planned (its source pinned until `take()`).

        Returns:
            The new page.
        """
        old = state.pages[index]
        (page,) = self.pool.get_new_pages(1)
        if copy_content:
            src_id = self.pending.resolve_copy_src(old.page_id)
            self.pool.touch([self.pool.pages[src_id]])
            self.pending.add_copy(src_id, page.page_id)
        state.pages[index] = page
        state.num_sent_pages = min(state.num_sent_pages, index)
        self.release([old])
        return page

    # -------------------------------------------------------------------- swap
    def num_swap_out_slots(self, state: RequestKV) -> int | None:
        """Host slots a swap-out needs, or None if a page's content is still in flight."""
        needed = 0
        for page in state.pages:
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

        The caller has checked `num_swap_out_slots` against the free host slots.

        Returns:
            The (device page, host slot) pairs planned.
        """
        state = self.requests[request.request_id]
        fresh_slots = iter(self.host_pool.allocate(self.num_swap_out_slots(state)))
        pairs, slot_ids = [], []
        for page in state.pages:
            if page.page_id in self.pending.swap_in_src:
                # NOTE: swapped in this very step: the host slot still holds the content.
                slot_ids.append(self.pending.reclaim_swap_in(page.page_id))
                continue
            slot = next(fresh_slots)
            pairs.append((self.pending.resolve_copy_src(page.page_id), slot))
            slot_ids.append(slot)
        self.pending.swap_out_pairs.extend(pairs)
        # NOTE: swap-in re-offers these pages to the prefix cache; never pages past the
        # computed tokens, whose KV the host copy does not hold.
        state.num_cached_pages = min(state.num_cached_pages,
                                     request.num_computed_tokens // self.page_size)
        pages, state.pages, state.host_slot_ids = state.pages, [], slot_ids
        state.num_sent_pages = 0
        self._offers.pop(request.request_id, None)
        self._released.append(request.request_id)
        self.release(reversed(pages))
        return pairs

    def move_to_device(self, request: Request) -> list[tuple[int, int]]:
        """Swaps a request in: fresh device pages in the same logical order as its slots.

        The caller has checked that the pool has the pages.

        Returns:
            The (host slot, device page) pairs planned.
        """
        state = self.requests[request.request_id]
        slot_ids = state.host_slot_ids
        pages = self.pool.get_new_pages(len(slot_ids))
        for slot, page in zip(slot_ids, pages, strict=True):
            self.pending.add_swap_in(slot, page.page_id)
        num_to_offer = state.num_cached_pages
        state.pages, state.host_slot_ids, state.num_cached_pages = pages, None, 0
        self.queue_for_cache(request, num_to_offer * self.page_size)
        return [(slot, page.page_id) for slot, page in zip(slot_ids, pages, strict=True)]

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
        """Offers the request's newly full pages (covering `num_tokens`) to the cache."""
        ps = self.page_size
        start = state.num_cached_pages
        num_full = min(num_tokens // ps, len(state.pages))
        if num_full <= start:
            return
        hashes = update_page_hashes(request, ps)
        token_ids = request.all_token_ids
        for index in range(start, num_full):
            self.pool.cache_full_page(state.pages[index], hashes[index],
                                      token_ids[index * ps:(index + 1) * ps])
        state.num_cached_pages = num_full

"""Data-parallel attention's KV cache manager: the page pool split into attention ranks, one
`KVCacheManager` each, behind the one manager's interface in global page ids."""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.core.allocation import plan_allocation
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_metrics import KVCacheStats
from jaxserve.core.plans import KVPlans, SwapPlan
from jaxserve.core.ranked_pools import RankedHostPool, RankedPagePool, summed_stats
from jaxserve.core.state_slots import NULL_STATE_SLOT, StateGroupSpec
from jaxserve.request import Request

PageIds = list[int] | tuple[list[int], ...]  # one group's ids, or a tuple of one list per group


class RankedKVCacheManager:
    """A `KVCacheManager` over `num_ranks` attention ranks (data-parallel attention): rank r
    owns global pages `[r * P, (r + 1) * P)` (P = `pages_per_rank`) and host slots
    `[r * H, (r + 1) * H)` (H = `host_slots_per_rank`), and a request's KV lies on one rank.

    Each rank is a `KVCacheManager` of P pages (its own null page, global page `r * P`,
    never handed out; its own prefix cache; its own host pool of `swap_space / num_ranks`
    GiB). Every id this manager takes or returns is global (block tables, deltas, prefix
    hits, copy and swap plans): local page p of rank r is `r * P + p`, local host slot h is
    `r * H + h`; the runner splits them by range.

    Assignment: a request gets its rank at its first admission attempt and, while it holds
    no pages and is not swapped out, again at each later one. Among the ranks where its
    first chunk fits, it takes the one with the fewest live requests (holding pages or host
    slots), then the most prefix-hit pages for it, then the lowest rank; where it fits
    nowhere, `get_computed_pages` still ranks all of them (the allocation then fails and the
    request waits). `get_computed_pages` estimates the chunk as what remains past the hit,
    at most `max_chunk_tokens`; a first `allocate_slots` with hit pages uses their rank, one
    without chooses again with its exact chunk. Once it holds pages (or host slots) it stays
    on its rank until freed; a fork (`fork`) goes to its parent's rank.

    Args:
        num_ranks: Attention ranks (devices of data-parallel attention).
        num_pages: Device pages of the whole pool, divisible by `num_ranks`.
        page_size: Token slots per page.
        **kwargs: `KVCacheManager`'s keyword arguments, for every rank (`swap_space` split
            evenly). `state_group` is refused.

    Attributes:
        ranks: The ranks' managers (local ids; read them, do not change them from outside).
        pages_per_rank: P, device pages per rank (each rank's null page included).
        host_slots_per_rank: H, host swap slots per rank.
        pool: The ranks' device pools as one (`RankedPagePool`: summed figures).
        host_pool: The ranks' host pools as one (`RankedHostPool`).

    Raises:
        ValueError: `num_ranks` < 1, `num_pages` not divisible by it, a `state_group`, or
            what `KVCacheManager` refuses.
    """

    # NOTE: a state group's slots would need splitting too; no DP-attention model has one.
    state_slots = None
    snapshots = None
    prefix_caching_disabled_reason = None

    def __init__(self, num_ranks: int, num_pages: int, page_size: int = 16, *,
                 enable_prefix_caching: bool = True, watermark: float = 0.01,
                 swap_space: float = 0.0, bytes_per_page: int = 0,
                 max_model_len: int | None = None, group_windows: tuple[int, ...] = (0,),
                 max_chunk_tokens: int | None = None, state_group: StateGroupSpec | None = None):
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if num_pages % num_ranks:
            raise ValueError(f"num_pages={num_pages} must be divisible by num_ranks={num_ranks}"
                             " (each attention rank owns num_pages // num_ranks pages)")
        if state_group is not None:
            raise ValueError("data-parallel attention does not serve linear-attention layers "
                             "(state_group)")
        self.num_ranks = num_ranks
        self.pages_per_rank = num_pages // num_ranks
        self.ranks = tuple(
            KVCacheManager(self.pages_per_rank, page_size,
                           enable_prefix_caching=enable_prefix_caching, watermark=watermark,
                           swap_space=swap_space / num_ranks, bytes_per_page=bytes_per_page,
                           max_model_len=max_model_len, group_windows=group_windows,
                           max_chunk_tokens=max_chunk_tokens)
            for _ in range(num_ranks))
        self.host_slots_per_rank = self.ranks[0].host_pool.num_slots
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.group_windows = tuple(group_windows)
        self.max_chunk_tokens = max_chunk_tokens
        self.pool = RankedPagePool([m.pool for m in self.ranks])
        self.host_pool = RankedHostPool([m.host_pool for m in self.ranks])
        self._rank: dict[str, int] = {}  # the requests holding pages or host slots

    # ------------------------------------------------------------- ranks, ids
    def rank_of(self, request_id: str) -> int:
        """The attention rank holding the request's KV.

        Raises:
            ValueError: The request holds no pages or host slots.
        """
        return self._rank_and_manager(request_id)[0]

    def page_range(self, rank: int) -> range:
        """Global page ids of a rank (its null page, `r * P`, first)."""
        return range(rank * self.pages_per_rank, (rank + 1) * self.pages_per_rank)

    def num_live(self, rank: int) -> int:
        """Requests holding pages or host slots of a rank."""
        return len(self.ranks[rank].tables.requests)

    def _rank_and_manager(self, request_id: str) -> tuple[int, KVCacheManager]:
        rank = self._rank.get(request_id)
        if rank is None:
            raise ValueError(f"request {request_id!r} holds no KV on any attention rank")
        return rank, self.ranks[rank]

    def _pages(self, rank: int, ids: Iterable[int]) -> list[int]:
        """Local page ids of a rank -> global ones."""
        base = rank * self.pages_per_rank
        return [base + p for p in ids]

    def _hits(self, rank: int, ids: PageIds) -> PageIds:
        """A rank's prefix-hit ids (as `KVCacheManager.get_computed_pages` returns them),
        local -> global."""
        return self._pages(rank, ids) if isinstance(ids, list) else tuple(
            self._pages(rank, group) for group in ids)

    def _local_hits(self, ids: PageIds) -> tuple[int | None, PageIds]:
        """Global prefix-hit ids -> (their rank, local ids); they must lie on one rank
        (None: no ids, the empty lists kept)."""
        flat = ids if isinstance(ids, list) else [p for group in ids for p in group]
        if not flat:
            return None, ids
        size = self.pages_per_rank
        rank = flat[0] // size
        if not 0 <= rank < self.num_ranks or any(p // size != rank for p in flat):
            raise ValueError(f"new_computed_page_ids {ids} must lie on one attention rank "
                             f"(pages [r * {size}, (r + 1) * {size}) for r < {self.num_ranks})")
        base = rank * size
        local = [p - base for p in ids] if isinstance(ids, list) else tuple(
            [p - base for p in group] for group in ids)
        return rank, local

    def _choose(self, fits: list[bool], hit_pages: list[int]) -> int:
        """The rank for a request holding nothing (the class docstring's rule), among the
        ranks where it fits (all of them where it fits nowhere)."""
        ranks = [r for r in range(self.num_ranks) if fits[r]] or range(self.num_ranks)
        return min(ranks, key=lambda r: (self.num_live(r), -hit_pages[r], r))

    def _fits(self, rank: int, request: Request, num_new_tokens: int,
              num_new_computed_tokens: int = 0, hit_ids: PageIds | None = None,
              num_lookahead_tokens: int = 0) -> bool:
        """Whether a first `allocate_slots` of the request (local hit ids) fits the rank."""
        manager = self.ranks[rank]
        hits = [[] for _ in self.group_windows] if not hit_ids else (
            [hit_ids] if isinstance(hit_ids, list) else list(hit_ids))
        return plan_allocation(manager.tables, request, num_new_tokens, num_new_computed_tokens,
                               hits, num_lookahead_tokens, max_model_len=self.max_model_len,
                               watermark_pages=manager.swapper.watermark_pages).fits

    # ----------------------------------------------------------------- lookups
    def has_request(self, request_id: str) -> bool:
        """Whether the request holds device pages or host slots (on any rank)."""
        return request_id in self._rank

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's KV sits in its rank's host pool."""
        rank = self._rank.get(request_id)
        return rank is not None and self.ranks[rank].is_swapped(request_id)

    def state_slot(self, request_id: str) -> int:
        """0: no state group (`KVCacheManager.state_slot`)."""
        return NULL_STATE_SLOT

    @property
    def num_groups(self) -> int:
        """KV cache groups (block tables per request)."""
        return len(self.group_windows)

    def page_ids(self, request_id: str, group: int = 0) -> list[int]:
        """`KVCacheManager.page_ids` in global ids (a sliding group's page given back: the
        rank's null page, `r * P`)."""
        rank, manager = self._rank_and_manager(request_id)
        return self._pages(rank, manager.page_ids(request_id, group))

    def page_delta(self, request_id: str) -> tuple[int, list[int]]:
        """`KVCacheManager.page_delta` in global ids."""
        rank, manager = self._rank_and_manager(request_id)
        start, ids = manager.page_delta(request_id)
        return start, self._pages(rank, ids)

    def page_deltas(self, request_id: str) -> list[tuple[int, list[int]]]:
        """`KVCacheManager.page_deltas` in global ids."""
        rank, manager = self._rank_and_manager(request_id)
        return [(start, self._pages(rank, ids)) for start, ids in manager.page_deltas(request_id)]

    def resend_pages(self, request_id: str) -> None:
        """`KVCacheManager.resend_pages` on the request's rank (nothing if it holds no KV)."""
        rank = self._rank.get(request_id)
        if rank is not None:
            self.ranks[rank].resend_pages(request_id)

    def take_released(self) -> list[str]:
        """`KVCacheManager.take_released` of every rank, rank by rank."""
        return [rid for manager in self.ranks for rid in manager.take_released()]

    @property
    def usage(self) -> float:
        """Fraction of usable pages, over all ranks, owned by requests."""
        return self.pool.num_used_pages / self.pool.num_usable_pages

    @property
    def max_tokens_per_request(self) -> int:
        """One rank's `KVCacheManager.max_tokens_per_request` (a request lives on one)."""
        return self.ranks[0].max_tokens_per_request

    def pages_for_tokens(self, num_tokens: int) -> int:
        """`KVCacheManager.pages_for_tokens` (the same on every rank)."""
        return self.ranks[0].pages_for_tokens(num_tokens)

    # ------------------------------------------------------------- allocation
    def get_computed_pages(self, request: Request) -> tuple[PageIds, int]:
        """Places a request holding nothing on a rank (the class docstring's rule) and
        returns that rank's prefix hit, as `KVCacheManager.get_computed_pages` does, in
        global ids.

        Raises:
            ValueError: The request already holds pages or is swapped out.
        """
        if self.has_request(request.request_id):
            raise ValueError(f"request {request.request_id!r} already holds KV; "
                             "get_computed_pages is for requests without pages")
        found = [manager.get_computed_pages(request) for manager in self.ranks]
        remaining = request.num_tokens_with_placeholders - request.num_computed_tokens
        fits = []
        for rank, (ids, num_hit) in enumerate(found):
            chunk = min(remaining - num_hit, self.max_chunk_tokens or remaining)
            fits.append(self._fits(rank, request, chunk, num_hit, ids))
        rank = self._choose(fits, [num_hit // self.page_size for _, num_hit in found])
        ids, num_hit = found[rank]
        return self._hits(rank, ids), num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_page_ids: PageIds | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """`KVCacheManager.allocate_slots` on the request's rank, in global ids. A request
        holding nothing goes to its hit pages' rank, or without hit pages to the rank the
        class docstring's rule picks among those where this allocation fits (None, with
        nothing changed, where it fits on none).

        Raises:
            ValueError: As `KVCacheManager.allocate_slots`; hit pages on several ranks.
        """
        request_id = request.request_id
        rank = self._rank.get(request_id)
        hit_rank, hits = (None, new_computed_page_ids) if new_computed_page_ids is None else (
            self._local_hits(new_computed_page_ids))
        if hit_rank is not None:
            if rank is not None and rank != hit_rank:
                raise ValueError(f"new_computed_page_ids of request {request_id!r} lie on rank "
                                 f"{hit_rank}; it holds KV on rank {rank}")
            rank = hit_rank
        elif rank is None:
            fits = [self._fits(r, request, num_new_tokens,
                               num_lookahead_tokens=num_lookahead_tokens)
                    for r in range(self.num_ranks)]
            if not any(fits):
                return None
            rank = self._choose(fits, [0] * self.num_ranks)
        new_ids = self.ranks[rank].allocate_slots(request, num_new_tokens,
                                                  num_new_computed_tokens, hits,
                                                  num_lookahead_tokens)
        if new_ids is None:
            return None
        self._rank[request_id] = rank
        return self._pages(rank, new_ids)

    def trim(self, request: Request) -> int:
        """`KVCacheManager.trim` on the request's rank (0 if it holds no KV)."""
        rank = self._rank.get(request.request_id)
        return 0 if rank is None else self.ranks[rank].trim(request)

    # -------------------------------------------------------------- lifecycle
    def free(self, request: Request) -> None:
        """`KVCacheManager.free` on the request's rank; it has no rank afterwards.

        Raises:
            ValueError: The request holds nothing (unknown or already freed).
        """
        _, manager = self._rank_and_manager(request.request_id)
        manager.free(request)
        del self._rank[request.request_id]

    def fork(self, parent: Request, child: Request) -> None:
        """`KVCacheManager.fork` on the parent's rank: the child lives there too.

        Raises:
            ValueError: As `KVCacheManager.fork`; a parent holding no KV.
        """
        rank, manager = self._rank_and_manager(parent.request_id)
        if child.request_id in self._rank:
            raise ValueError(f"cannot fork into {child.request_id!r}: it already holds KV")
        manager.fork(parent, child)
        self._rank[child.request_id] = rank

    def can_fork(self, parent: Request, num_tokens: int) -> bool:
        """`KVCacheManager.can_fork` on the parent's rank (False if it holds no KV)."""
        rank = self._rank.get(parent.request_id)
        return rank is not None and self.ranks[rank].can_fork(parent, num_tokens)

    def can_swap_out(self, request: Request) -> bool:
        """`KVCacheManager.can_swap_out` on the request's rank (its own host slots)."""
        return self._rank_and_manager(request.request_id)[1].can_swap_out(request)

    def swap_out(self, request: Request) -> SwapPlan | None:
        """`KVCacheManager.swap_out` on the request's rank, pairs in global ids."""
        rank, manager = self._rank_and_manager(request.request_id)
        plan = manager.swap_out(request)
        return None if plan is None else SwapPlan(self._swap_pairs(rank, plan.pairs, True))

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """`KVCacheManager.can_swap_in` on the request's rank."""
        return self._rank_and_manager(request.request_id)[1].can_swap_in(request, num_new_tokens)

    def swap_in(self, request: Request) -> SwapPlan | None:
        """`KVCacheManager.swap_in` on the request's rank, pairs in global ids."""
        rank, manager = self._rank_and_manager(request.request_id)
        plan = manager.swap_in(request)
        return None if plan is None else SwapPlan(self._swap_pairs(rank, plan.pairs, False),
                                                  to_host=False)

    def _swap_pairs(self, rank: int, pairs: list[tuple[int, int]],
                    to_host: bool) -> list[tuple[int, int]]:
        """A rank's swap pairs, local -> global: (page, slot) out, (slot, page) in."""
        page, slot = rank * self.pages_per_rank, rank * self.host_slots_per_rank
        if to_host:
            return [(page + p, slot + s) for p, s in pairs]
        return [(slot + s, page + p) for s, p in pairs]

    # ---------------------------------------------------------- step / metrics
    def take_plans(self) -> KVPlans:
        """Every rank's `KVCacheManager.take_plans`, rank by rank, in global ids; call once
        per step."""
        plans = KVPlans()
        for rank, manager in enumerate(self.ranks):
            part, base = manager.take_plans(), rank * self.pages_per_rank
            plans.swap_out.pairs += self._swap_pairs(rank, part.swap_out.pairs, True)
            plans.swap_in.pairs += self._swap_pairs(rank, part.swap_in.pairs, False)
            plans.copy.pairs += [(base + s, base + d) for s, d in part.copy.pairs]
        return plans

    def evict_cached_pages(self, max_num_pages: int | None = None) -> int:
        """Forgets up to `max_num_pages` unowned cached pages (all if None), rank 0's first,
        each rank's LRU first; returns how many."""
        num_evicted = 0
        for manager in self.ranks:
            left = None if max_num_pages is None else max_num_pages - num_evicted
            num_evicted += manager.evict_cached_pages(left)
        return num_evicted

    def stats(self) -> KVCacheStats:
        """`KVCacheManager.stats` summed over the ranks (ratios of the sums)."""
        return summed_stats([manager.stats() for manager in self.ranks])


"""`KVSwapper`: swap preemption of the KV cache manager, a request's pages to host slots and
back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.plans import SwapPlan
from jaxserve.request import Request
from jaxserve.utils import cdiv

if TYPE_CHECKING:
    from jaxserve.core.block_tables import BlockTables
    from jaxserve.core.kv_metrics import KVCacheCounters
    from jaxserve.core.page_pool import HostPool, PagePool
    from jaxserve.core.state_slots import StateSlots


class KVSwapper:
    """Moves requests' KV between device pages and host slots (`KVCacheManager` delegates
    its swap calls here).

    Args:
        tables: The manager's `BlockTables` (over its device pool and host slots).
        counters: The manager's counters (swaps are counted there).
        watermark_pages: Device pages a swap-in must leave free.
        state_slots: The manager's state group, if any: a request's state slot moves with its
            pages (a host state slot out, any free device slot back in).
    """

    def __init__(self, tables: BlockTables, counters: KVCacheCounters, watermark_pages: int,
                 state_slots: StateSlots | None = None):
        self.tables = tables
        self.counters = counters
        self.watermark_pages = watermark_pages
        self.state_slots = state_slots

    @property
    def pool(self) -> PagePool:
        """The device page pool."""
        return self.tables.pool

    @property
    def host_pool(self) -> HostPool:
        """The host swap slots."""
        return self.tables.host_pool

    def can_swap_out(self, request: Request) -> bool:
        """Whether `swap_out` would succeed now."""
        needed = self.tables.num_swap_out_slots(self.tables.on_device(request.request_id))
        return (needed is not None and needed <= self.host_pool.num_free_slots
                and (self.state_slots is None
                     or self.state_slots.can_swap_out(request.request_id)))

    def swap_out(self, request: Request) -> SwapPlan | None:
        """Moves a request's pages to host slots and frees the device pages.

        Returns:
            The request's (device page, host slot) pairs (also part of the next
            `take_plans()`), or None when host slots (or host state slots) are short:
            nothing changed, so the caller falls back to recompute (`free` and restart
            from token 0).

        Raises:
            ValueError: Unknown or already swapped-out request.
        """
        if self.tables.is_swapped(request.request_id):
            raise ValueError(f"request {request.request_id!r} is already swapped out")
        if not self.can_swap_out(request):
            self.counters.num_swap_fallbacks += 1
            return None
        pairs = self.tables.move_to_host(request)
        if self.state_slots is not None:
            self.state_slots.swap_out(request.request_id)
        self.counters.num_swap_outs += 1
        self.counters.num_swapped_out_pages += len(pairs)
        return SwapPlan(pairs, to_host=True)

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Whether `swap_in` would succeed now (watermark included), and the free pages
        would also cover the request's next `num_new_tokens` tokens (with a state group, a
        device state slot is free too).

        Raises:
            ValueError: The request is not swapped out.
        """
        slot_ids = self.tables.swapped_out(request.request_id).host_slot_ids
        num_free = self.pool.num_allocatable_pages
        num_next = cdiv(request.num_computed_tokens + num_new_tokens, self.tables.page_size)
        return (len(slot_ids) + self.watermark_pages <= num_free and
                num_next * self.tables.num_groups <= num_free
                and (self.state_slots is None or self.state_slots.can_swap_in()))

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
        if self.state_slots is not None:
            self.state_slots.swap_in(request.request_id)
        self.counters.num_swap_ins += 1
        self.counters.num_swapped_in_pages += len(pairs)
        return SwapPlan(pairs, to_host=False)


"""Prefix caching for linear-attention state: snapshots of request states at page boundaries,
kept in spare state slots keyed by the page hash, and the chunk alignment that makes them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.core.kv_page import PageHash
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.core.state_slots import StateGroupSpec, StateSlots
from jaxserve.request import Request


@dataclass
class _Snapshot:
    slot: int
    # A request's slot the snapshot copies at the next `take` (None: `slot` holds it), and
    # the request whose step that copy waits on.
    pending_src: int | None = None
    from_request: str | None = None


class StateSnapshots:
    """States of page-aligned prefixes in spare state slots, keyed by the block hash of the
    prefix's last page (the hash chains over the whole prefix), evicted least recently used.

    Per step: `note_step` records a request whose step ends on a page boundary; `take`
    (with the manager's `take_plans`) registers its snapshot, whose copy (request slot ->
    snapshot slot) runs with the next step's plans, once the step has computed the state.
    Until then a hit reads the request's slot itself, which holds that state until the
    next step (copies gather before they scatter, so a slot freed and handed out again is
    still read first). A step ending on a page whose tokens are not known yet (a sampled
    token in flight) is registered one `take` later and copied at once.

    Args:
        first_slot: The first of the device rows set aside (after the requests' slots).
        num_slots: How many (at least 1).
        page_size: Tokens per page.
    """

    def __init__(self, first_slot: int, num_slots: int, page_size: int):
        if num_slots < 1:
            raise ValueError(f"num_snapshot_slots must be >= 1, got {num_slots}")
        self.first_slot, self.num_slots, self.page_size = first_slot, num_slots, page_size
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._index: OrderedDict[PageHash, _Snapshot] = OrderedDict()  # LRU first
        self._noted: dict[str, tuple[Request, int]] = {}  # this pass: request -> boundary
        self._late: list[tuple[Request, int, int]] = []  # (request, boundary, its slot)
        self._copies: dict[int, int] = {}  # while in `take`: snapshot slot -> source slot

    def __len__(self) -> int:
        return len(self._index)

    @property
    def num_free_slots(self) -> int:
        """Snapshot slots holding nothing."""
        return len(self._free)

    def held_slots(self) -> list[int]:
        """The slots of the snapshots kept (or registered to be copied at the next take)."""
        return [snap.slot for snap in self._index.values()]

    # ------------------------------------------------------------------ lookups
    def longest(self, hashes: list[PageHash], num_pages: int) -> int:
        """The most leading pages, at most `num_pages`, whose prefix has a snapshot (0:
        none): what bounds a prefix hit of a model with a state group."""
        return next((k for k in range(num_pages, 0, -1) if hashes[k - 1] in self._index), 0)

    def source(self, request: Request, num_tokens: int) -> int:
        """The slot a request hitting its first `num_tokens` tokens copies its state from
        (`StateSlots.allocate(copy_from=)`); marks the snapshot recently used.

        Raises:
            ValueError: No snapshot of that prefix (not page-aligned, or none kept).
        """
        index = num_tokens // self.page_size - 1
        hashes = update_page_hashes(request, self.page_size)
        snap = (self._index.get(hashes[index]) if num_tokens % self.page_size == 0
                and 0 <= index < len(hashes) else None)
        if snap is None:
            raise ValueError(f"request {request.request_id!r} hits {num_tokens} tokens, but "
                             "no state snapshot holds that prefix (use get_computed_pages)")
        self._index.move_to_end(hashes[index])
        return snap.slot if snap.pending_src is None else snap.pending_src

    def align_chunk(self, request: Request, num_new: int, num_cached: int = 0) -> int:
        """A prefill chunk of up to `num_new` tokens (after `num_cached` hit ones) cut to end
        on a page boundary, up to the last full page of the known tokens; past it the rest
        goes as is, and so does a chunk too short to reach the next boundary (no stall)."""
        ps = self.page_size
        start = request.num_computed_tokens + num_cached
        last_full = request.num_tokens // ps * ps
        if start >= last_full:
            return num_new
        end = min(start + num_new, last_full)
        end = end if end == last_full else end // ps * ps
        return end - start if end > start else num_new

    # --------------------------------------------------------------------- step
    def note_step(self, request: Request, num_tokens_after: int) -> None:
        """Records that the request's step this pass ends at `num_tokens_after` tokens (a
        snapshot when that is a page boundary); a later call for it this pass replaces it."""
        if num_tokens_after and num_tokens_after % self.page_size == 0:
            self._noted[request.request_id] = (request, num_tokens_after)
        else:
            self._noted.pop(request.request_id, None)

    def drop_noted(self, request_id: str) -> None:
        """The request left its slot before its step ran (freed, swapped out): no snapshot."""
        self._noted.pop(request_id, None)

    def cancel_step(self, request_id: str) -> None:
        """The request's last step never ran (its dispatch failed): forgets the snapshots
        registered from it and not copied yet."""
        self._noted.pop(request_id, None)
        self._late = [entry for entry in self._late if entry[0].request_id != request_id]
        for key in [k for k, s in self._index.items() if s.from_request == request_id]:
            self._free.append(self._index.pop(key).slot)

    def take(self, slot_of: Callable[[str], int]) -> list[tuple[int, int]]:
        """This step's snapshot copies, `(src_slot, snapshot_slot)`; registers the snapshots
        of the steps noted since the last call. `slot_of` gives a request's device slot."""
        self._copies = {}
        for snap in self._index.values():
            if snap.pending_src is not None:
                self._copies[snap.slot] = snap.pending_src
                snap.pending_src = snap.from_request = None
        late, self._late = self._late, []
        for request, boundary, src in late:
            key = self._key(request, boundary)
            if key is not None:
                self._store(key, src, None)
        for request_id, (request, boundary) in self._noted.items():
            src, key = slot_of(request_id), self._key(request, boundary)
            if key is None:
                self._late.append((request, boundary, src))
            else:
                self._store(key, src, request_id)
        self._noted.clear()
        copies, self._copies = self._copies, {}
        return [(src, dst) for dst, src in copies.items()]

    def _key(self, request: Request, boundary: int) -> PageHash | None:
        hashes = update_page_hashes(request, self.page_size)
        index = boundary // self.page_size - 1
        return hashes[index] if index < len(hashes) else None

    def _store(self, key: PageHash, src: int, from_request: str | None) -> None:
        """Keeps a snapshot of `key` copied from `src`: now (this take's copies) or, with
        `from_request`, at the next take."""
        if key in self._index:
            self._index.move_to_end(key)  # NOTE: its slot holds (or will hold) that state
            return
        if not self._free:
            self._free.append(self._index.popitem(last=False)[1].slot)
        slot = self._free.pop()
        self._copies.pop(slot, None)  # NOTE: an evicted snapshot's copy is moot
        if from_request is None:
            self._copies[slot] = src
            self._index[key] = _Snapshot(slot)
        else:
            self._index[key] = _Snapshot(slot, src, from_request)

    def clear(self) -> None:
        """Forgets every snapshot (`reset_prefix_cache`, sleep: the pools are freed)."""
        self._free.extend(snap.slot for snap in self._index.values())
        self._index.clear()
        self._noted.clear()
        self._late.clear()


def build_state_group(spec: StateGroupSpec, swap_space: float, enable_prefix_caching: bool,
                      page_size: int) -> tuple[StateSlots, StateSnapshots | None, str | None]:
    """The KV manager's state group: its `StateSlots` (host slots: `spec.num_host_slots`,
    else one per slot when swapping is on), its `StateSnapshots` when prefix caching is on
    and the spec sets snapshot slots aside, and why prefix caching is off (None: on, or not
    asked for)."""
    num_host = spec.num_host_slots
    if num_host is None:
        num_host = spec.num_request_slots - 1 if swap_space > 0 else 0
    slots = StateSlots(spec, num_host)
    if not enable_prefix_caching:
        return slots, None, None
    if not spec.num_snapshot_slots:
        # NOTE: a hit would skip tokens whose state no slot holds.
        return slots, None, ("prefix caching is off: the model keeps per-request "
                             "linear-attention state and no state snapshot slots were set "
                             "aside (num_state_snapshots=0)")
    snapshots = StateSnapshots(spec.num_slots, spec.num_snapshot_slots, page_size)
    slots.on_release = snapshots.drop_noted
    return slots, snapshots, None

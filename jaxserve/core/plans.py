"""Page and state copy and swap plans the manager emits and the model runner executes before
a step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def _pairs_array(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.asarray(pairs, dtype=np.int32).reshape(len(pairs), 2)


@dataclass
class CopyPlan:
    """Device page copies for copy-on-write: `(src_page_id, dst_page_id)` pairs.

    Pairs are independent (no dst is another pair's src), so one gather/scatter runs them.
    """

    pairs: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.pairs)

    def as_array(self) -> np.ndarray:
        """i32[num_pairs, 2] of (src, dst)."""
        return _pairs_array(self.pairs)


@dataclass
class SwapPlan:
    """Page moves between device pages and host slots, as `(src, dst)` pairs.

    Swap-out pairs are `(device_page_id, host_slot_id)`; swap-in pairs are
    `(host_slot_id, device_page_id)`.
    """

    pairs: list[tuple[int, int]] = field(default_factory=list)
    to_host: bool = True

    def __len__(self) -> int:
        return len(self.pairs)

    def as_array(self) -> np.ndarray:
        """i32[num_pairs, 2] of (src, dst)."""
        return _pairs_array(self.pairs)


@dataclass
class StatePlans:
    """State-slot moves of a model with a state group (`core/state_slots.py`), in this order.

    1. `swap_out` (device slot -> host slot): `(slot, host_slot)` pairs.
    2. `copy` (device slot -> device slot): forks, `(src_slot, dst_slot)` pairs. Run as one
       gather then one scatter: a dst may be another pair's src (a slot given back this
       step and handed out again), which must be read first.
    3. `swap_in` (host slot -> device slot): `(host_slot, slot)` pairs; a host slot may
       feed several slots (a request swapped in, then forked).
    Every move reads what the previous step left, since only the last kind writes what
    others read; the slots are rows of the state pools, slot 0 the padding rows' slot.
    """

    swap_out: SwapPlan = field(default_factory=lambda: SwapPlan(to_host=True))
    copy: CopyPlan = field(default_factory=CopyPlan)
    swap_in: SwapPlan = field(default_factory=lambda: SwapPlan(to_host=False))

    def is_empty(self) -> bool:
        """Whether there is nothing to move."""
        return not (self.swap_out.pairs or self.copy.pairs or self.swap_in.pairs)


@dataclass
class KVPlans:
    """Everything the runner must move before one step, in this order.

    1. `swap_out` (device -> host): reads pages that this step may hand to others.
    2. `swap_in` (host -> device): fills pages of resumed requests.
    3. `copy` (device -> device): copy-on-write; a src may be a page just swapped in.
    `state` (its own order: `StatePlans`) touches other arrays, so it may run before or
    after them. Then the step itself writes the new tokens' KV and states.
    """

    swap_out: SwapPlan = field(default_factory=lambda: SwapPlan(to_host=True))
    swap_in: SwapPlan = field(default_factory=lambda: SwapPlan(to_host=False))
    copy: CopyPlan = field(default_factory=CopyPlan)
    state: StatePlans = field(default_factory=StatePlans)

    def is_empty(self) -> bool:
        """Whether there is nothing to move."""
        return not (self.swap_out.pairs or self.swap_in.pairs or self.copy.pairs
                    or not self.state.is_empty())


class PendingPlans:
    """This step's not-yet-executed moves and what they keep alive until the runner runs.

    NOTE: the order swap-out, swap-in, copy is safe only if no move reads something a
    previous move of the same step overwrote. So copy sources stay pinned (an extra ref
    count) and host slots released by swap-in stay out of the host pool until `take()`;
    pages freed by swap-out may be reused at once because swap-out runs first.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.swap_out_pairs: list[tuple[int, int]] = []
        # dst page id -> host slot id / src page id, for pages whose content is in flight.
        self.swap_in_src: dict[int, int] = {}
        self.copy_src: dict[int, int] = {}
        # page id -> number of pending copies reading it (each holds one ref count).
        self.pins: dict[int, int] = {}
        self.deferred_slot_ids: list[int] = []

    def is_empty(self) -> bool:
        """Whether nothing is pending or held."""
        return not (self.swap_out_pairs or self.swap_in_src or self.copy_src
                    or self.pins or self.deferred_slot_ids)

    def resolve_copy_src(self, page_id: int) -> int:
        """The page a copy from `page_id` must read (its own pending copy source if any)."""
        return self.copy_src.get(page_id, page_id)

    def add_copy(self, src_page_id: int, dst_page_id: int) -> None:
        """Records a copy; the caller has already pinned `src_page_id`."""
        self.copy_src[dst_page_id] = src_page_id
        self.pins[src_page_id] = self.pins.get(src_page_id, 0) + 1

    def num_pins(self, page_id: int) -> int:
        """Ref counts on `page_id` held by pending copies rather than block tables."""
        return self.pins.get(page_id, 0)

    def add_swap_in(self, slot_id: int, dst_page_id: int) -> None:
        """Records a host -> device move; the slot is released at `take()`."""
        self.swap_in_src[dst_page_id] = slot_id
        self.deferred_slot_ids.append(slot_id)

    def reclaim_swap_in(self, dst_page_id: int) -> int:
        """Cancels a pending swap-in into `dst_page_id`; returns its still-valid host slot."""
        slot_id = self.swap_in_src.pop(dst_page_id)
        self.deferred_slot_ids.remove(slot_id)
        return slot_id

    def drop_page(self, page_id: int) -> None:
        """Forgets moves into a page that lost its last owner (its content is moot)."""
        self.copy_src.pop(page_id, None)
        self.swap_in_src.pop(page_id, None)

    def drop_swap_out_slots(self, slot_ids: list[int]) -> None:
        """Forgets swap-outs into host slots that are freed before the runner ran them."""
        dropped = set(slot_ids)
        self.swap_out_pairs = [(p, s) for p, s in self.swap_out_pairs if s not in dropped]

    def take(self) -> tuple[KVPlans, list[int], list[int]]:
        """Drains the plans; returns them with the pinned page ids and deferred slot ids."""
        plans = KVPlans(
            swap_out=SwapPlan(self.swap_out_pairs, to_host=True),
            swap_in=SwapPlan([(s, d) for d, s in self.swap_in_src.items()], to_host=False),
            copy=CopyPlan([(s, d) for d, s in self.copy_src.items()]))
        pinned = [page_id for page_id, n in self.pins.items() for _ in range(n)]
        deferred = self.deferred_slot_ids
        self._reset()
        return plans, pinned, deferred

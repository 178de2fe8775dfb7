"""The state group: one fixed-size state slot per request (linear-attention layers), host
copies for swap, and this step's state moves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.core.plans import CopyPlan, StatePlans, SwapPlan
from jaxserve.core.state_backups import StateBackups

NULL_STATE_SLOT = 0  # padding rows' slot: never handed out


@dataclass(frozen=True)
class StateGroupSpec:
    """Sizes of a model's state group (Gated DeltaNet, Mamba-2 layers).

    Attributes:
        num_slots: Device state slots (rows of the state pools), the null slot 0 and the
            backup slots included (at least 2 besides the backups; the scheduler needs
            `max_num_seqs + 1` besides them: `default_num_state_slots`).
        bytes_per_slot: Bytes of one slot across all the group's layers (each layer's
            convolution and recurrent state), on one device.
        num_host_slots: Host slots for swap preemption; None: `num_request_slots - 1` when
            swapping is on (the manager's `swap_space` > 0), else 0. Their bytes come on top
            of `swap_space`, which sizes the host pages.
        num_backup_slots: The last this many of the `num_slots` rows hold backups of the
            states of requests verifying proposals (speculative decoding:
            `core/state_backups.py`); 0 without speculation.
        num_snapshot_slots: Device rows after the `num_slots` rows for prefix caching's
            state snapshots (`StateSnapshots`); 0: none, and no prefix caching.

    Raises:
        ValueError: A size out of range (the message names the field).
    """

    num_slots: int
    bytes_per_slot: int
    num_host_slots: int | None = None
    num_backup_slots: int = 0
    num_snapshot_slots: int = 0

    @property
    def num_rows(self) -> int:
        """Rows of the device state pools: the requests' slots (the null slot included),
        the backup slots, then the snapshot slots."""
        return self.num_slots + self.num_snapshot_slots

    def __post_init__(self):
        if self.num_backup_slots < 0:
            raise ValueError(f"num_backup_slots must be >= 0, got {self.num_backup_slots}")
        if self.num_slots - self.num_backup_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (the null slot plus one) besides "
                             f"num_backup_slots={self.num_backup_slots}, got {self.num_slots}")
        if self.bytes_per_slot <= 0:
            raise ValueError(f"bytes_per_slot must be positive, got {self.bytes_per_slot}")
        if self.num_host_slots is not None and self.num_host_slots < 0:
            raise ValueError(f"num_host_slots must be >= 0, got {self.num_host_slots}")
        if self.num_snapshot_slots < 0:
            raise ValueError(f"num_snapshot_slots must be >= 0, got {self.num_snapshot_slots}")

    @property
    def num_request_slots(self) -> int:
        """Rows requests hold (the null slot included): all but the backup slots."""
        return self.num_slots - self.num_backup_slots


def default_num_state_slots(max_num_seqs: int) -> int:
    """State slots a scheduler of `max_num_seqs` sequences needs: one per running request
    (fan-out children and `kv_from` forks count as sequences) plus the null slot. Swap and
    fork copies take ordinary slots, so no spare ones."""
    return max_num_seqs + 1


def num_pages_after_state(kv_bytes: int, bytes_per_page: int, num_state_slots: int,
                          bytes_per_state_slot: int) -> int:
    """KV pages (the null page included) that `kv_bytes` of device memory holds once
    `num_state_slots` state slots are taken out of it: what the worker sizes the page pool
    with for a model with a state group. The state is per request, not per token, so the
    page budget (`max_tokens_per_request`) stays in pages.

    Raises:
        ValueError: A size out of range, or the state slots alone outgrow `kv_bytes`.
    """
    if bytes_per_page <= 0:
        raise ValueError(f"bytes_per_page must be positive, got {bytes_per_page}")
    StateGroupSpec(num_state_slots, bytes_per_state_slot)  # checks both
    state_bytes = num_state_slots * bytes_per_state_slot
    if state_bytes > kv_bytes:
        raise ValueError(f"{num_state_slots} state slots of {bytes_per_state_slot} bytes "
                         f"({state_bytes / 2**20:.1f} MiB) outgrow the KV memory "
                         f"({kv_bytes / 2**20:.1f} MiB): lower max_num_seqs or raise "
                         "gpu_memory_utilization")
    return (kv_bytes - state_bytes) // bytes_per_page


class StateSlots:
    """Which request holds which device state slot (or host slot while swapped out), and
    the moves the runner makes before the next step (`take`).

    Every move reads the state as the previous step left it: the runner runs swap-outs,
    then copies (one gather, then one scatter), then swap-ins, so the reads come before
    every write. A request therefore records only where its state is *read from* this
    step (`_source`: its parent's slot after a fork, a host slot after a swap-in), and
    `take` turns that into copies and swap-ins. A slot given back is reusable at once;
    host slots a swap-in reads stay out of the host pool until `take`.

    Args:
        spec: The group's sizes.
        num_host_slots: Host slots for swap (0: state requests preempt by recompute).
    """

    def __init__(self, spec: StateGroupSpec, num_host_slots: int = 0):
        self.spec = spec
        self.num_host_slots = num_host_slots
        # NOTE: stacks, lowest ids on top first: recently freed (warm) slots reused first.
        self._free = list(range(spec.num_request_slots - 1, 0, -1))
        # Speculative decoding's backups, rows past the requests' own.
        self.backups = StateBackups(spec.num_request_slots, spec.num_backup_slots)
        self._host_free = list(range(num_host_slots - 1, -1, -1))
        self.slot_of: dict[str, int] = {}  # requests on device -> slot
        self.host_slot_of: dict[str, int] = {}  # swapped-out requests -> host slot
        # request on device -> ("slot", s) or ("host", h): where this step reads its state
        # from, if not its own slot. A new request has none: the step starts it from zero.
        self._source: dict[str, tuple[str, int]] = {}
        self._swap_out_pairs: list[tuple[int, int]] = []
        self._deferred_host: list[int] = []  # read by this step's swap-ins
        # Called with a request that gives back its device slot (`free`, `swap_out`).
        self.on_release: Callable[[str], None] | None = None

    # ----------------------------------------------------------------- lookups
    @property
    def num_slots(self) -> int:
        """Device slots, the null slot and the backup slots included."""
        return self.spec.num_slots

    @property
    def num_request_slots(self) -> int:
        """Device slots requests hold, the null slot included (not the backup slots)."""
        return self.spec.num_request_slots

    @property
    def num_free_slots(self) -> int:
        """Device slots (not backup slots) no request holds."""
        return len(self._free)

    @property
    def num_free_host_slots(self) -> int:
        """Host slots no swapped-out request holds (nor a swap-in of this step reads)."""
        return len(self._host_free)

    def holds(self, request_id: str) -> bool:
        """Whether the request holds a device or a host slot."""
        return request_id in self.slot_of or request_id in self.host_slot_of

    def slot(self, request_id: str) -> int:
        """The request's device slot.

        Raises:
            ValueError: The request holds none (unknown, freed, or swapped out).
        """
        if request_id not in self.slot_of:
            what = "is swapped out" if request_id in self.host_slot_of else "holds no state slot"
            raise ValueError(f"request {request_id!r} {what}")
        return self.slot_of[request_id]

    # --------------------------------------------------------------- lifecycle
    def allocate(self, request_id: str, copy_from: int | None = None) -> int:
        """Gives a new (or recompute-restarted) request a slot; its first step starts the
        state from zero (the step's first chunk has kv_len == q_len), or, with `copy_from`
        (a prefix hit: `StateSnapshots.source`), from a copy of that slot's state.

        Raises:
            ValueError: The request already holds a slot, or none is free.
        """
        if self.holds(request_id):
            raise ValueError(f"request {request_id!r} already holds a state slot")
        slot = self._take_slot(request_id)
        if copy_from is not None:
            self._source[request_id] = ("slot", copy_from)
        return slot

    def _take_slot(self, request_id: str) -> int:
        if not self._free:
            raise ValueError(f"no free state slot for request {request_id!r} (all "
                             f"{self.num_request_slots - 1} held)")
        slot = self.slot_of[request_id] = self._free.pop()
        return slot

    def free(self, request_id: str) -> None:
        """Gives back the request's device slot or host slot.

        Raises:
            ValueError: The request holds neither (unknown, or freed already).
        """
        if request_id in self.slot_of:
            self._free.append(self.slot_of.pop(request_id))
            self._source.pop(request_id, None)
            self._released(request_id)
            self.backups.release(request_id)
        elif request_id in self.host_slot_of:
            host = self.host_slot_of.pop(request_id)
            # NOTE: a swap-out into it this step would land after a later reuse's.
            self._swap_out_pairs = [(s, h) for s, h in self._swap_out_pairs if h != host]
            self._host_free.append(host)
        else:
            raise ValueError(f"request {request_id!r} holds no state slot (unknown or "
                             "freed twice)")

    def fork(self, parent_id: str, child_id: str) -> int:
        """Gives `child_id` a slot holding a copy of the parent's state (state cannot be
        shared by reference: both go on writing it); returns the child's slot.

        Raises:
            ValueError: The parent holds no device slot, the child holds one already, or
                none is free.
        """
        parent_slot = self.slot(parent_id)
        if self.holds(child_id):
            raise ValueError(f"cannot fork into {child_id!r}: it already holds a state slot")
        source = self._source.get(parent_id, ("slot", parent_slot))
        slot = self._take_slot(child_id)
        self._source[child_id] = source
        return slot

    # -------------------------------------------------------------------- swap
    def can_swap_out(self, request_id: str) -> bool:
        """Whether `swap_out` would succeed now: a host slot is free (or the one its
        swap-in of this step reads, when no fork reads that one too)."""
        source = self._source.get(request_id)
        if source is not None and source[0] == "host":
            return self._num_readers(source) == 1
        return bool(self._host_free)

    def _num_readers(self, source: tuple[str, int]) -> int:
        return sum(1 for s in self._source.values() if s == source)

    def swap_out(self, request_id: str) -> int:
        """Moves the request's state to a host slot and frees its device slot; returns the
        host slot.

        Raises:
            ValueError: The request holds no device slot, or `can_swap_out` is False.
        """
        slot = self.slot(request_id)
        if not self.can_swap_out(request_id):
            raise ValueError(f"cannot swap out request {request_id!r}: no host state slot")
        self.backups.release(request_id)  # the step it was for does not run
        source = self._source.pop(request_id, ("slot", slot))
        if source[0] == "host":  # swapped in this very step: the host slot still holds it
            host = source[1]
            self._deferred_host.remove(host)
        else:
            host = self._host_free.pop()
            self._swap_out_pairs.append((source[1], host))
        del self.slot_of[request_id]
        self._free.append(slot)
        self.host_slot_of[request_id] = host
        self._released(request_id)
        return host

    def _released(self, request_id: str) -> None:
        if self.on_release is not None:
            self.on_release(request_id)

    def can_swap_in(self) -> bool:
        """Whether a device slot is free for a swap-in."""
        return bool(self._free)

    def swap_in(self, request_id: str) -> int:
        """Brings a swapped-out request's state back into a free device slot (any one);
        returns it.

        Raises:
            ValueError: The request is not swapped out, or no slot is free.
        """
        if request_id not in self.host_slot_of:
            raise ValueError(f"request {request_id!r} is not swapped out")
        slot = self._take_slot(request_id)
        host = self.host_slot_of.pop(request_id)
        self._source[request_id] = ("host", host)
        self._deferred_host.append(host)
        return slot

    # ----------------------------------------------------------------- backups
    def can_back_up(self, request_id: str) -> bool:
        """Whether `back_up` would succeed now: the request holds a device slot whose state
        is on the device (not swapped in this pass) and no backup, and a backup slot is free."""
        source = self._source.get(request_id)
        return (request_id in self.slot_of and not self.backups.holds(request_id)
                and bool(self.backups.num_free) and (source is None or source[0] == "slot"))

    def back_up(self, request_id: str) -> int:
        """Copies the request's state (where this step reads it from) into a backup slot
        before the step: it is about to verify proposals. Returns the backup slot.

        Raises:
            ValueError: `can_back_up` is False (the message says why).
        """
        kind, source = self._source.get(request_id, ("slot", self.slot(request_id)))
        if kind != "slot":
            raise ValueError(f"cannot back up request {request_id!r}: its state is swapped "
                             "in this step")
        return self.backups.take_slot(request_id, source)

    def drop_backup(self, request_id: str) -> None:
        """Gives back the request's backup slot, if any: its state is right as it stands (every
        proposal held, or the step it was taken for never ran)."""
        self.backups.release(request_id)

    def restore_backup(self, request_id: str) -> bool:
        """Reads the request's state back from its backup slot (a copy in the next plans) and
        gives the backup slot back: a proposal was rejected, so the state went past the
        request's tokens. Returns False, moving nothing, when the backup's copy never ran.

        Raises:
            ValueError: The request holds no device slot or no backup.
        """
        self.slot(request_id)
        if not self.backups.holds(request_id):
            raise ValueError(f"request {request_id!r} holds no backup state slot")
        backup = self.backups.restore(request_id)
        if backup is None:
            return False
        self._source[request_id] = ("slot", backup)
        return True

    # -------------------------------------------------------------------- step
    def take(self) -> StatePlans:
        """Drains this step's state moves for the runner; call once per step (with
        `KVCacheManager.take_plans`)."""
        copies, swap_ins = [], []
        for request_id, (kind, src) in self._source.items():
            dst = self.slot_of[request_id]
            if kind == "host":
                swap_ins.append((src, dst))
            elif src != dst:  # NOTE: a child may get back its parent's slot, freed meanwhile
                copies.append((src, dst))
        copies += self.backups.take()  # NOTE: all copies gather before any scatters
        plans = StatePlans(swap_out=SwapPlan(self._swap_out_pairs, to_host=True),
                           copy=CopyPlan(copies), swap_in=SwapPlan(swap_ins, to_host=False))
        self._host_free.extend(self._deferred_host)
        self._source, self._swap_out_pairs, self._deferred_host = {}, [], []
        return plans

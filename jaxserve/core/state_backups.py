"""Backup state slots for speculative decoding of linear-attention hybrids: a verifying
request's state copied aside before its step, restored when a proposal is rejected."""

from __future__ import annotations


def default_num_backup_slots(max_num_seqs: int, speculating: bool) -> int:
    """Backup slots an engine keeps: one per sequence when it speculates (every running
    request may verify proposals in one step), else none. Fewer also serve: a request that
    finds no free backup verifies no proposals that step."""
    return max_num_seqs if speculating else 0


class StateBackups:
    """The backup rows of a state group (`StateSlots.backups`) and which request holds which.

    A request verifying proposals advances its state over every proposal, rejected ones
    included, and a state cannot be trimmed back like pages. So before the step its state is
    copied into a backup row (a copy in that step's `StatePlans`: it runs before the compute);
    after the step the backup is dropped (every proposal held) or read back (the scheduler
    then recomputes the accepted tokens: `OutputUpdater`). The copy is pending until `take`:
    a backup released before then (the request preempted in the same pass, or its step
    never ran) moves nothing.

    Args:
        first_slot: The first backup row of the state pools (they follow the requests' rows).
        num_slots: Backup rows (0: no speculation for the group).

    Raises:
        ValueError: A size out of range (the message names the field).
    """

    def __init__(self, first_slot: int, num_slots: int):
        if first_slot < 1:
            raise ValueError(f"first_slot must be >= 1 (slot 0 is the null slot), got "
                             f"{first_slot}")
        if num_slots < 0:
            raise ValueError(f"num_backup_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # NOTE: a stack, lowest id on top: recently released rows are reused first.
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.backup_of: dict[str, int] = {}  # request -> its backup row
        self._pending: dict[str, tuple[int, int]] = {}  # request -> (src, backup): not taken
        self.num_backups = 0  # backups taken (verify steps of a state group)
        self.num_restores = 0  # backups read back (a proposal rejected: tokens recomputed)

    @property
    def num_free(self) -> int:
        """Backup rows no request holds."""
        return len(self._free)

    def holds(self, request_id: str) -> bool:
        """Whether the request holds a backup row."""
        return request_id in self.backup_of

    def take_slot(self, request_id: str, source: int) -> int:
        """Gives the request a backup row and plans the copy of its state (read from device
        row `source`, where this step reads it) into it; returns the row.

        Raises:
            ValueError: The request holds a backup already, or none is free.
        """
        if request_id in self.backup_of:
            raise ValueError(f"request {request_id!r} already holds a backup state slot")
        if not self._free:
            raise ValueError(f"no free backup state slot for request {request_id!r} (all "
                             f"{self.num_slots} held)")
        backup = self.backup_of[request_id] = self._free.pop()
        self._pending[request_id] = (source, backup)
        self.num_backups += 1
        return backup

    def release(self, request_id: str) -> int | None:
        """Gives the request's backup row back (reusable at once: every move of a pass reads
        before any writes); returns it if its copy already ran (the row holds the state), or
        None if it never did (the copy is cancelled) or the request holds none."""
        backup = self.backup_of.pop(request_id, None)
        if backup is None:
            return None
        self._free.append(backup)
        return None if self._pending.pop(request_id, None) else backup

    def restore(self, request_id: str) -> int | None:
        """`release`, counted as a restore when the row holds the state (it is read back)."""
        backup = self.release(request_id)
        self.num_restores += backup is not None
        return backup

    def take(self) -> list[tuple[int, int]]:
        """Drains this pass's backup copies, (source row, backup row) pairs."""
        pairs, self._pending = list(self._pending.values()), {}
        return pairs

"""The runner's persistent block tables: one row per request, updated by the scheduler's deltas.

The scheduler sends each request's whole block table once (when it first runs, after a
swap-in) and from then on only what changed: the table from the first changed index on
(`ScheduledRequest.pages_from`), which for a decode is nothing at all except once a page.
This keeps each row between steps; a step's tables are one NumPy gather of its rows.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler_output import ScheduledRequest


class BlockTableRows:
    """Block tables kept between steps, by request id, plus scratch rows for hand-built steps.

    Args:
        max_pages_per_seq: Width of a table.
        num_rows: Rows to start with (more are added when requests outnumber them).
    """

    def __init__(self, max_pages_per_seq: int, num_rows: int = 64):
        self.width = max_pages_per_seq
        self.table = np.zeros((max(1, num_rows), max_pages_per_seq), np.int32)  # i32[rows, w]
        self.lengths = [0] * len(self.table)  # pages in each row
        self.slot_of: dict[str, int] = {}  # request id -> its row
        self._free = list(range(len(self.table) - 1, -1, -1))  # rows nobody holds

    @property
    def num_kept(self) -> int:
        """Requests whose rows are kept."""
        return len(self.slot_of)

    @property
    def num_free(self) -> int:
        """Rows nobody holds (with `num_kept`, every row: none is lost)."""
        return len(self._free)

    def release(self, request_ids) -> None:
        """Forgets the rows of requests whose tables were dropped (unknown ids: ignored)."""
        for request_id in request_ids:
            slot = self.slot_of.pop(request_id, None)
            if slot is not None:
                self._clear(slot)
                self._free.append(slot)

    def gather(self, sched: list[ScheduledRequest], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Applies the step's deltas and returns its block tables, padded to `num_rows`.

        Args:
            sched: The step's entries, in row order; an entry whose `pages_from` is None
                carries its whole table and keeps no row.
            num_rows: The row bucket.

        Returns:
            (i32[num_rows, max_pages_per_seq] tables, padding 0; i64[len(sched)] pages in
            each entry's table).

        Raises:
            ValueError: A table wider than `max_pages_per_seq`, or a delta against a row the
                runner does not hold or that is shorter than where the delta starts.
        """
        slots = np.empty(len(sched), np.int64)  # i64[r]
        scratch: list[int] = []
        try:
            for i, s in enumerate(sched):
                if s.pages_from is None:
                    slot = self._take_row()
                    scratch.append(slot)
                    self._write(slot, 0, s.page_ids, s.request_id)
                else:
                    slot = self._row(s)
                slots[i] = slot
            tables = np.zeros((num_rows, self.width), np.int32)  # i32[num_rows, w]
            tables[:len(sched)] = self.table[slots]
            lengths = np.fromiter((self.lengths[k] for k in slots), np.int64, len(sched))
        finally:
            for slot in scratch:
                self._clear(slot)
                self._free.append(slot)
        return tables, lengths

    def _row(self, s: ScheduledRequest) -> int:
        """The entry's kept row with its delta applied (a new row for a whole table)."""
        slot = self.slot_of.get(s.request_id)
        if slot is not None:
            if s.page_ids or s.pages_from != self.lengths[slot]:
                self._write(slot, s.pages_from, s.page_ids, s.request_id)
            return slot
        if s.pages_from:
            raise ValueError(f"request {s.request_id!r}: a block-table delta from page "
                             f"{s.pages_from}, but the runner holds no table for it")
        slot = self._take_row()
        try:
            self._write(slot, 0, s.page_ids, s.request_id)
        except ValueError:
            self._free.append(slot)
            raise
        self.slot_of[s.request_id] = slot
        return slot

    def _write(self, slot: int, start: int, page_ids: list[int], request_id: str) -> None:
        """Row `slot` becomes its first `start` pages followed by `page_ids`."""
        end = start + len(page_ids)
        if end > self.width:
            raise ValueError(f"request {request_id!r}: a block table of {end} pages exceeds "
                             f"max_pages_per_seq={self.width}")
        old = self.lengths[slot]
        if start > old:
            raise ValueError(f"request {request_id!r}: a block-table delta from page {start}, "
                             f"but the runner holds {old} pages of it")
        row = self.table[slot]  # i32[w], a view
        row[start:end] = page_ids
        if old > end:
            row[end:old] = 0
        self.lengths[slot] = end

    def _clear(self, slot: int) -> None:
        self.table[slot, :self.lengths[slot]] = 0
        self.lengths[slot] = 0

    def _take_row(self) -> int:
        if not self._free:  # NOTE: rows are few KiB; double them rather than fail
            n = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lengths.extend([0] * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

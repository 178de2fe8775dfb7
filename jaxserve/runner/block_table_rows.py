"""The runner's persistent block tables: one row per request, updated by the scheduler's deltas.

The scheduler sends each request's whole block table once (when it first runs, after a
swap-in) and from then on only what changed: the table from the first changed index on
(`ScheduledRequest.pages_from`), which for a decode is nothing at all except once a page.
This keeps each row between steps; a step's tables are one NumPy gather of its rows.
With a hybrid KV cache (`models.kv_groups`) the runner keeps one `BlockTableRows` per KV
cache group, each applying that group's deltas (`ScheduledRequest.group_pages`; `group_delta`).
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler_output import ScheduledRequest


def group_delta(s: ScheduledRequest, group: int) -> tuple[int | None, list[int]]:
    """(pages_from, page_ids) of an entry's block table in KV cache group `group`: group 0's
    are the entry's own fields, group g's `s.group_pages[g - 1]` (whose `pages_from` counts
    only when the entry's does: None means whole tables, nothing kept).

    Raises:
        ValueError: The entry carries no table for `group`.
    """
    if group == 0:
        return s.pages_from, s.page_ids
    if not 0 < group <= len(s.group_pages):
        raise ValueError(f"request {s.request_id!r}: no block table of KV cache group {group} "
                         f"(group_pages holds {len(s.group_pages)} groups after group 0)")
    pages_from, page_ids = s.group_pages[group - 1]
    return (None if s.pages_from is None else pages_from), page_ids


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

    def gather(self, sched: list[ScheduledRequest], num_rows: int,
               group: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Applies the step's deltas and returns its block tables, padded to `num_rows`.

        Args:
            sched: The step's entries, in row order; an entry whose `pages_from` is None
                carries its whole table and keeps no row.
            num_rows: The row bucket.
            group: The KV cache group whose tables these rows keep (`group_delta`).

        Returns:
            (i32[num_rows, max_pages_per_seq] tables, padding 0; i64[len(sched)] pages in
            each entry's table).

        Raises:
            ValueError: A table wider than `max_pages_per_seq`, a delta against a row the
                runner does not hold or that is shorter than where the delta starts, or an
                entry without a table of `group`.
        """
        slots = np.empty(len(sched), np.int64)  # i64[r]
        scratch: list[int] = []
        try:
            for i, s in enumerate(sched):
                pages_from, page_ids = group_delta(s, group)
                if pages_from is None:
                    slot = self._take_row()
                    scratch.append(slot)
                    self._write(slot, 0, page_ids, s.request_id)
                else:
                    slot = self._row(s.request_id, pages_from, page_ids)
                slots[i] = slot
            tables = np.zeros((num_rows, self.width), np.int32)  # i32[num_rows, w]
            tables[:len(sched)] = self.table[slots]
            lengths = np.fromiter((self.lengths[k] for k in slots), np.int64, len(sched))
        finally:
            for slot in scratch:
                self._clear(slot)
                self._free.append(slot)
        return tables, lengths

    def _row(self, request_id: str, pages_from: int, page_ids: list[int]) -> int:
        """The request's kept row with its delta applied (a new row for a whole table)."""
        slot = self.slot_of.get(request_id)
        if slot is not None:
            if page_ids or pages_from != self.lengths[slot]:
                self._write(slot, pages_from, page_ids, request_id)
            return slot
        if pages_from:
            raise ValueError(f"request {request_id!r}: a block-table delta from page "
                             f"{pages_from}, but the runner holds no table for it")
        slot = self._take_row()
        try:
            self._write(slot, 0, page_ids, request_id)
        except ValueError:
            self._free.append(slot)
            raise
        self.slot_of[request_id] = slot
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

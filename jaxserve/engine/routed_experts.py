"""Routing capture of a mixture of experts: each request's routed experts per position and
layer, recorded from every step, shared through prefix-cache pages, handed to its
completion when it finishes (vLLM's `enable_return_routed_experts`, for routing replay in
RL training)."""

from __future__ import annotations

import collections

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.request import Request

UNKNOWN = -1  # a position whose routing no step of this engine recorded (nor a dense layer's)


class _Record:
    """One request's routing so far: i16[capacity, L, k] by position, and which positions
    a step has written."""

    def __init__(self, num_layers: int, top_k: int, capacity: int = 64):
        self.ids = np.full((capacity, num_layers, top_k), UNKNOWN, np.int16)
        self.known = np.zeros(capacity, bool)
        self.num_published = 0  # full pages already shared under their prefix hash

    def copy(self) -> _Record:
        rec = _Record.__new__(_Record)
        rec.ids, rec.known, rec.num_published = self.ids.copy(), self.known.copy(), 0
        return rec

    def grow(self, size: int) -> None:
        """Room for `size` positions at least (doubling), the new ones unknown."""
        if size > len(self.known):
            grow = max(size, 2 * len(self.known)) - len(self.known)
            self.ids = np.concatenate(
                [self.ids, np.full((grow, *self.ids.shape[1:]), UNKNOWN, np.int16)])
            self.known = np.concatenate([self.known, np.zeros(grow, bool)])

    def write(self, start: int, ids: np.ndarray) -> None:
        end = start + len(ids)
        self.grow(end)
        self.ids[start:end] = ids
        self.known[start:end] = True


class RoutedExperts:
    """The routing the engine's steps computed, by request and by prefix-cache page.

    A request's positions come from the steps that computed them (recomputation after a
    preemption writes them again; rejected proposals are overwritten or cut off). Positions
    it took from the prefix cache come from the request that computed those pages: each
    full page's routing is kept under its prefix hash, for as many pages as the pool holds
    (the oldest dropped first). A completion forked from another (n > 1, beam search)
    starts from its parent's record.

    Args:
        num_layers: The model's layers.
        top_k: Experts per token.
        page_size: Tokens per KV page (the prefix cache's unit).
        max_pages: Most pages whose routing is kept for prefix hits (the pool's size).
    """

    def __init__(self, num_layers: int, top_k: int, page_size: int, max_pages: int):
        self.num_layers, self.top_k = num_layers, top_k
        self.page_size, self.max_pages = page_size, max_pages
        self._records: dict[str, _Record] = {}
        # {prefix hash: i16[page_size, L, k]}, least recently used first.
        self._pages: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        """Requests with a record (live ones that computed something)."""
        return len(self._records)

    def record(self, out: SchedulerOutput, requests: dict[str, Request],
               routed: np.ndarray) -> None:
        """Stores a step's routing: `routed` i32[tokens, L, k], the scheduled entries'
        tokens in their order (`StepResult.routed_experts`)."""
        t = 0
        for s in out.scheduled:
            req = requests[s.request_id]
            n = s.num_new_tokens
            if not req.is_finished():  # an overlapped step past its end
                rec = self._record_of(req, s.start_pos)
                rec.write(s.start_pos, routed[t:t + n])
                self._publish(req, rec)
            t += n

    def take(self, req: Request, length: int) -> np.ndarray:
        """i32[length, L, k]: the finished request's routing of positions 0..length-1
        (prefix hits filled from their pages, `UNKNOWN` where none was kept); its
        record is dropped."""
        # NOTE: without a record it computed nothing of its own (a fan-out child that
        # ended at once): its parent's.
        rec = self._records.pop(req.request_id, None) or self._start(req)
        self._fill_from_pages(req, rec, length)
        return rec.ids[:length].astype(np.int32)

    def fork(self, parent_id: str, request_id: str) -> None:
        """Starts `request_id`'s record from its parent's (`LLMEngine.fork_request`: the
        positions it shares were computed by the parent)."""
        parent = self._records.get(parent_id)
        if parent is not None:
            self._records[request_id] = parent.copy()

    def drop(self, request_id: str) -> None:
        """Forgets an aborted request's record."""
        self._records.pop(request_id, None)

    def _record_of(self, req: Request, start: int) -> _Record:
        """The request's record; a new one starts from its parent's, its first `start`
        positions (prefix hits) filled from their pages now, while they are kept."""
        rec = self._records.get(req.request_id)
        if rec is None:
            rec = self._records[req.request_id] = self._start(req)
            self._fill_from_pages(req, rec, start)
        return rec

    def _start(self, req: Request) -> _Record:
        """A new record: a copy of its parent's (a fan-out child), else empty."""
        parent = self._records.get(req.forked_from) if req.forked_from else None
        return parent.copy() if parent is not None else _Record(self.num_layers, self.top_k)

    def _fill_from_pages(self, req: Request, rec: _Record, length: int) -> None:
        """Fills the unknown positions below `length` from the pages kept under the
        request's prefix hashes (each page used becomes the most recent)."""
        rec.grow(length)
        ps = self.page_size
        for page in np.unique(np.flatnonzero(~rec.known[:length]) // ps):
            key = req.page_hashes[page] if page < len(req.page_hashes) else None
            ids = self._pages.get(key) if key is not None else None
            if ids is not None:
                self._pages.move_to_end(key)
                lo = page * ps
                missing = ~rec.known[lo:lo + ps]
                rec.ids[lo:lo + ps][missing] = ids[missing]
                rec.known[lo:lo + ps] = True

    def _publish(self, req: Request, rec: _Record) -> None:
        """Keeps the routing of the request's full pages that are wholly known under their
        prefix hashes (a hash is known once the KV cache manager indexed the page)."""
        ps = self.page_size
        while rec.num_published < len(req.page_hashes):
            lo = rec.num_published * ps
            if lo + ps > len(rec.known) or not rec.known[lo:lo + ps].all():
                break
            key = req.page_hashes[rec.num_published]
            self._pages[key] = rec.ids[lo:lo + ps].copy()
            self._pages.move_to_end(key)
            rec.num_published += 1
        while len(self._pages) > self.max_pages:
            self._pages.popitem(last=False)

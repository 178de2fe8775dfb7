"""`HeadPages`: the EAGLE-3 head's page pool, each request's pages in it, and their prefix cache.

A request's head pages hold its positions from `base` on (page i: positions base + i * ps ..).
The head's K/V at position p reads the target's states at p and token p + 1, so a full head
page i of a request whose head starts at 0 is fixed by the target page's chained hash
(`Request.page_hashes[i]`: tokens 0 .. (i + 1) * ps - 1, and so the states) and the token
after it: it is cached under that hash with those ps tokens (1 .. ps after the page's start)
and found again by a request whose target starts past a prefix hit, whose states the target
did not compute. Without every page before its first computed position the head starts at
that position instead (`base`).
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.kv_page import KVPage
from jaxserve.core.page_pool import PagePool
from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.request import Request, RequestStatus
from jaxserve.utils import cdiv


@dataclasses.dataclass
class HeadSeq:
    """One request's state in the head's pool."""

    request: Request
    base: int  # the first position the head holds
    pages: list[KVPage]
    next: int = 0  # positions [base, next) hold the head's K/V of known tokens
    num_cached: int = 0  # leading pages indexed in the prefix cache (base 0 only)


class HeadPages:
    """The head's pages (see the module docstring).

    Args:
        num_pages: Pages in its pool (the null page included).
        page_size: Slots per page (the target's: its page hashes index the cache).
        lookahead: Positions past a request's last known one the proposals write (k - 1).
        max_pages: Most pages of one request (a block table's width).
    """

    def __init__(self, num_pages: int, page_size: int, lookahead: int, max_pages: int):
        self.pool = PagePool(num_pages, enable_caching=True)
        self.page_size, self.lookahead, self.max_pages = page_size, lookahead, max_pages
        self.seqs: dict[str, HeadSeq] = {}
        self.num_cached_pages_hit = 0  # head pages found in its prefix cache

    def release_finished(self) -> None:
        """Frees the pages of finished requests."""
        for req_id in [i for i, s in self.seqs.items() if s.request.is_finished()]:
            self.free(req_id)

    def free(self, req_id: str) -> None:
        seq = self.seqs.pop(req_id)
        self.pool.free_pages(reversed(seq.pages))

    def reserve(self, request: Request, start: int, last: int) -> HeadSeq | None:
        """The request's state with pages through position `last` and the lookahead, for a
        target step that computed positions `start` .. `last`; None when the pool is out of
        pages even after dropping requests that are not running (its state is dropped)."""
        seq = self.seqs.get(request.request_id)
        if seq is not None and (seq.request is not request or seq.next < start):
            self.free(request.request_id)  # the id was reused, or positions were skipped
            seq = None
        if seq is None:
            seq = self.seqs[request.request_id] = self._start(request, start)
        length = last + 1 + self.lookahead - seq.base
        need = cdiv(length, self.page_size) - len(seq.pages)
        if need > self.pool.num_allocatable_pages:
            idle = [i for i, s in self.seqs.items() if i != request.request_id
                    and s.request.status != RequestStatus.RUNNING]
            for req_id in idle:
                self.free(req_id)  # NOTE: preempted requests' heads give way first
        if need > self.pool.num_allocatable_pages or length > self.max_pages * self.page_size:
            self.free(request.request_id)
            return None
        if need > 0:
            seq.pages.extend(self.pool.get_new_pages(need))
        return seq

    def _start(self, request: Request, start: int) -> HeadSeq:
        """A new state from position `start`: from 0 with the cached pages of the positions
        before it when they are all there (it is then a page boundary), else from `start`."""
        ps = self.page_size
        if start == 0 or start % ps:
            return HeadSeq(request, start, [], start)
        hashes, tokens = update_page_hashes(request, ps), request.all_token_ids
        pages = []
        for i in range(start // ps):
            page = None if i >= len(hashes) else self.pool.get_cached_page(
                hashes[i], tokens[i * ps + 1:(i + 1) * ps + 1])
            if page is None:
                return HeadSeq(request, start, [], start)
            pages.append(page)
        self.pool.touch(pages)
        self.num_cached_pages_hit += len(pages)
        return HeadSeq(request, 0, pages, start, len(pages))

    def cache_full(self, seq: HeadSeq) -> None:
        """Indexes the request's head pages that became full and fixed (base 0)."""
        if seq.base:
            return
        ps = self.page_size
        hashes, tokens = update_page_hashes(seq.request, ps), seq.request.all_token_ids
        # NOTE: page i also needs its next token: position (i + 1) * ps - 1 is known.
        while (seq.num_cached < min(len(seq.pages), len(hashes), seq.next // ps)
               and (seq.num_cached + 1) * ps < len(tokens)):
            i = seq.num_cached
            self.pool.cache_full_page(seq.pages[i], hashes[i], tokens[i * ps + 1:(i + 1) * ps + 1])
            seq.num_cached += 1

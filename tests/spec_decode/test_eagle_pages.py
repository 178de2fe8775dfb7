"""`HeadPages`, the EAGLE-3 head's pages: reservation, restarts after gaps, the prefix cache
keyed by the target's page hashes (and the token after each page), and running out."""

from __future__ import annotations

from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.eagle_pages import HeadPages

PS = 4


def request(req_id: str, tokens: list[int]) -> Request:
    r = Request(req_id, list(tokens), sampling_params=SamplingParams(max_tokens=8))
    r.status = RequestStatus.RUNNING
    return r


def observed(pages: HeadPages, r: Request, start: int, last: int):
    """As `Eagle3Speculator.observe` does for a target step of positions start..last."""
    seq = pages.reserve(r, start, last)
    if seq is not None:
        seq.next = max(seq.next, last + 1)
        pages.cache_full(seq)
    return seq


def test_pages_cover_the_positions_and_the_lookahead():
    pages = HeadPages(16, PS, lookahead=2, max_pages=8)
    r = request("a", range(10))
    seq = observed(pages, r, 0, 8)  # 9 positions + 2 proposals: 3 pages
    assert (seq.base, seq.next, len(seq.pages)) == (0, 9, 3)
    assert observed(pages, r, 9, 9) is seq and len(seq.pages) == 3
    pages.release_finished()
    assert "a" in pages.seqs
    r.status = RequestStatus.FINISHED_STOPPED
    pages.release_finished()
    assert not pages.seqs and pages.pool.num_used_pages == 0


def test_a_gap_restarts_the_request_and_a_reused_id_starts_anew():
    pages = HeadPages(16, PS, lookahead=1, max_pages=8)
    r = request("a", range(12))
    observed(pages, r, 0, 3)
    seq = observed(pages, r, 7, 9)  # positions 4..6 never came: start at 7
    assert (seq.base, seq.next, len(seq.pages)) == (7, 10, 1)
    other = request("a", range(5))  # the id again, another request
    seq = observed(pages, other, 0, 2)
    assert seq.request is other and seq.base == 0 and pages.pool.num_used_pages == 1


def test_a_target_prefix_hit_finds_the_heads_pages():
    """Pages are found when the target's page hashes and the token after each page match;
    another next token is a miss (the head's K/V at a page's last position read it)."""
    pages = HeadPages(16, PS, lookahead=1, max_pages=8)
    first = request("a", range(11))
    observed(pages, first, 0, 9)  # positions 0..9: pages 0 and 1 full and fixed
    first.status = RequestStatus.FINISHED_STOPPED
    pages.release_finished()
    same = request("b", [*range(9), 50, 51])  # the same first 9 tokens
    seq = observed(pages, same, 8, 9)  # the target hit 8 positions (2 pages)
    assert (seq.base, len(seq.pages), pages.num_cached_pages_hit) == (0, 3, 2)
    differs = request("c", [*range(8), 99, 98])  # token 8 differs: page 1's K/V does not fit
    seq = observed(pages, differs, 8, 8)
    assert seq.base == 8 and pages.num_cached_pages_hit == 2


def test_running_out_drops_idle_heads_first_then_the_request():
    pages = HeadPages(5, PS, lookahead=0, max_pages=8)  # 4 usable pages
    idle, busy = request("idle", range(9)), request("busy", range(9))
    observed(pages, idle, 0, 7)  # 2 pages
    idle.status = RequestStatus.PREEMPTED
    assert observed(pages, busy, 0, 11) is not None  # 3 pages: the idle one gave way
    assert "idle" not in pages.seqs
    late = request("late", range(9))
    assert observed(pages, late, 0, 7) is None and "late" not in pages.seqs
    assert observed(pages, request("long", range(40)), 0, 35) is None  # past max_pages

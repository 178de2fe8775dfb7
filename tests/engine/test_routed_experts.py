"""`RoutedExperts`: routing recorded per position, shared through prefix pages, forks."""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.engine.routed_experts import UNKNOWN, RoutedExperts
from jaxserve.request import Request, RequestStatus

L, K, PAGE = 2, 2, 4


def _ids(start: int, n: int) -> np.ndarray:
    """i32[n, L, K] whose values name their position (so a misplaced row shows)."""
    pos = np.arange(start, start + n)[:, None, None]
    return (pos * 10 + np.arange(L)[None, :, None] * 3 + np.arange(K)).astype(np.int32) % 997


def _step(store: RoutedExperts, *entries: tuple[Request, int, int]) -> None:
    """One step computing `n` tokens from `start` of each request, packed in order."""
    sched = [ScheduledRequest(r.request_id, [0] * n, start, [], 0) for r, start, n in entries]
    routed = np.concatenate([_ids(start, n) for _, start, n in entries])
    store.record(SchedulerOutput(scheduled=sched), {r.request_id: r for r, _, _ in entries},
                 routed)


def _request(rid: str, num_tokens: int, hashes: int = 0) -> Request:
    req = Request(rid, range(1, num_tokens + 1))
    req.page_hashes = [f"page{i}".encode() for i in range(hashes)]
    return req


def test_positions_from_every_step_and_prefix_hits_from_pages():
    store = RoutedExperts(L, K, PAGE, max_pages=8)
    a = _request("a", 10, hashes=2)
    _step(store, (a, 0, 6))
    _step(store, (a, 6, 4))  # a chunk, then the rest
    np.testing.assert_array_equal(store.take(a, 10), _ids(0, 10))
    # b hit a's two full pages: it computes from position 8 only.
    b = _request("b", 12, hashes=3)
    b.page_hashes[2] = b"other"
    _step(store, (b, 8, 4))
    got = store.take(b, 12)
    np.testing.assert_array_equal(got, _ids(0, 12))
    assert got.dtype == np.int32 and len(store) == 0


def test_positions_no_step_recorded_are_unknown():
    store = RoutedExperts(L, K, PAGE, max_pages=1)
    a, c = _request("a", 8, hashes=2), _request("c", 8, hashes=2)
    _step(store, (a, 0, 8))
    store.take(a, 8)  # page0 then page1 kept; one page kept at most: page0 dropped
    _step(store, (c, 8, 1))
    got = store.take(c, 10)  # position 9: never computed
    assert (got[:4] == UNKNOWN).all() and (got[9:] == UNKNOWN).all()
    np.testing.assert_array_equal(got[4:9], _ids(4, 5))


def test_a_partly_known_page_is_not_shared():
    store = RoutedExperts(L, K, PAGE, max_pages=8)
    a = _request("a", 6, hashes=1)
    _step(store, (a, 2, 4))  # positions 0-1 unknown (say, hits on pages not kept)
    b = _request("b", 5, hashes=1)
    _step(store, (b, 4, 1))
    assert (store.take(b, 5)[:4] == UNKNOWN).all()


def test_fan_out_child_and_fork_start_from_the_parent():
    store = RoutedExperts(L, K, PAGE, max_pages=8)
    parent = _request("p", 6)
    _step(store, (parent, 0, 6))
    child = parent.fork("p#1")
    child.forked_from = "p"
    # The child ended at once (nothing computed of its own): the parent's prompt.
    np.testing.assert_array_equal(store.take(child, 6), _ids(0, 6))
    other = parent.fork("p#2")
    other.forked_from = "p"
    _step(store, (parent, 6, 1), (other, 6, 1))
    np.testing.assert_array_equal(store.take(other, 7), _ids(0, 7))
    store.fork("p", "beam")
    np.testing.assert_array_equal(store.take(_request("beam", 7), 7), _ids(0, 7))
    store.drop("p")
    assert len(store) == 0


def test_a_finished_request_in_an_overlapped_step_leaves_no_record():
    store = RoutedExperts(L, K, PAGE, max_pages=8)
    a = _request("a", 4)
    a.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _step(store, (a, 4, 1))
    assert len(store) == 0

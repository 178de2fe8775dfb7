"""KVCacheManager and Request misuse: every ValueError path and its message."""

from __future__ import annotations

import pytest

from jaxserve.core import KVCacheManager
from jaxserve.request import Request
from tests.core.kv_helpers import admit, make


@pytest.mark.parametrize("kwargs, match", [
    ({"page_size": 0}, "page_size must be positive"),
    ({"page_size": -4}, "page_size must be positive"),
    ({"num_pages": 1}, "num_pages must be >= 2"),
    ({"watermark": 1.0}, "watermark must lie in"),
    ({"watermark": -0.1}, "watermark must lie in"),
    ({"max_model_len": 0}, "max_model_len must be positive"),
    ({"swap_space": -1.0}, "swap_space must be >= 0"),
    ({"swap_space": 1.0, "bytes_per_page": 0}, "bytes_per_page must be positive"),
])
def test_constructor_errors(kwargs, match):
    args = {"num_pages": 8, "page_size": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        KVCacheManager(args.pop("num_pages"), args.pop("page_size"), **args)


def test_request_errors():
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        Request("r", [])
    with pytest.raises(ValueError, match="non-empty string"):
        Request("", [1])


def test_allocation_errors():
    manager = make(num_pages=5, max_model_len=14, swap_space=1.0, bytes_per_page=2**26)
    request = Request("r", list(range(20)))
    for kwargs, match in [
        ({"num_new_tokens": -1}, "num_new_tokens must be >= 0"),
        ({"num_new_tokens": 1, "num_lookahead_tokens": -1}, "num_lookahead_tokens must be"),
        ({"num_new_tokens": 1, "num_new_computed_tokens": -4}, "num_new_computed_tokens must"),
        ({"num_new_tokens": 1, "num_new_computed_tokens": 4}, "must equal 0 hit pages"),
        ({"num_new_tokens": 21}, "has 20 tokens"),
        ({"num_new_tokens": 15}, "over max_model_len=14"),
        ({"num_new_tokens": 1, "num_new_computed_tokens": 4, "new_computed_page_ids": [0]},
         "outside"),
        ({"num_new_tokens": 1, "num_new_computed_tokens": 4, "new_computed_page_ids": [2]},
         "not the cached page 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            manager.allocate_slots(request, **kwargs)
    with pytest.raises(ValueError, match="needs 5 pages; the pool has only 4"):
        make(num_pages=5).allocate_slots(request, 20)
    small = Request("s", list(range(12)))
    admit(manager, small)
    with pytest.raises(ValueError, match="prefix hits only on its first allocation"):
        manager.allocate_slots(small, 0, 4, manager.page_ids("s")[:1])
    with pytest.raises(ValueError, match="already holds KV"):
        manager.get_computed_pages(small)
    manager.swap_out(small)
    with pytest.raises(ValueError, match="swapped out; swap_in first"):
        manager.allocate_slots(small, 1)


def test_stale_prefix_hit_is_rejected():
    manager = make()
    admit(manager, Request("a", list(range(9))))
    manager.free(Request("a", [0]))
    late = Request("b", list(range(9)))
    hit_ids, num_hit = manager.get_computed_pages(late)
    manager.evict_cached_pages()
    with pytest.raises(ValueError, match="stale"):
        manager.allocate_slots(late, 1, num_hit, hit_ids)


def test_unknown_request_errors():
    manager = make(swap_space=1.0, bytes_per_page=2**26)
    ghost = Request("ghost", [1, 2])
    for call in (lambda: manager.page_ids("ghost"), lambda: manager.free(ghost),
                 lambda: manager.swap_out(ghost), lambda: manager.can_swap_out(ghost),
                 lambda: manager.fork(ghost, Request("kid", [1, 2]))):
        with pytest.raises(ValueError, match="'ghost' holds no pages"):
            call()
    with pytest.raises(ValueError, match="'ghost' is not swapped out"):
        manager.swap_in(ghost)


def test_fork_swap_and_free_misuse_errors():
    manager = make(swap_space=1.0, bytes_per_page=2**26)
    parent = Request("p", list(range(6)))
    admit(manager, parent)
    other = Request("o", [9])
    admit(manager, other)
    with pytest.raises(ValueError, match="cannot fork into 'o': it already holds KV"):
        manager.fork(parent, other)
    with pytest.raises(ValueError, match="must match parent"):
        manager.fork(parent, Request("k", [5, 5, 5, 5, 5, 5]))
    with pytest.raises(ValueError, match="'p' is not swapped out"):
        manager.swap_in(parent)
    manager.swap_out(parent)
    with pytest.raises(ValueError, match="already swapped out"):
        manager.swap_out(parent)
    with pytest.raises(ValueError, match="'p' is swapped out"):
        manager.fork(parent, parent.fork("k2"))
    manager.free(other)
    with pytest.raises(ValueError, match="'o' holds no pages"):
        manager.free(other)

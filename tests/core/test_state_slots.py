"""The state-slot pool (`StateSlots`): allocation, forks, swap, the plans it emits, errors."""

from __future__ import annotations

import pytest

from jaxserve.core.state_slots import (
    StateGroupSpec,
    StateSlots,
    default_num_state_slots,
    num_pages_after_state,
)


def make(num_slots: int = 5, num_host_slots: int = 2) -> StateSlots:
    return StateSlots(StateGroupSpec(num_slots, 64), num_host_slots)


def plans(slots: StateSlots) -> tuple[list, list, list]:
    p = slots.take()
    return p.swap_out.pairs, p.copy.pairs, p.swap_in.pairs


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_slots": 1, "bytes_per_slot": 8}, "num_slots"),
    ({"num_slots": 3, "bytes_per_slot": 0}, "bytes_per_slot"),
    ({"num_slots": 3, "bytes_per_slot": 8, "num_host_slots": -1}, "num_host_slots"),
])
def test_spec_rejects_bad_sizes_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StateGroupSpec(**kwargs)


def test_budget_helpers():
    assert default_num_state_slots(8) == 9
    # 1000 bytes less 3 slots of 100 bytes leave 7 pages of 100 bytes.
    assert num_pages_after_state(1000, 100, 3, 100) == 7
    assert num_pages_after_state(1000, 100, 3, 99) == 7  # 703 bytes: 7 whole pages
    with pytest.raises(ValueError, match="outgrow the KV memory"):
        num_pages_after_state(1000, 100, 11, 100)
    with pytest.raises(ValueError, match="bytes_per_page"):
        num_pages_after_state(1000, 0, 3, 100)
    with pytest.raises(ValueError, match="bytes_per_slot"):
        num_pages_after_state(1000, 100, 3, 0)


def test_allocate_hands_out_every_slot_but_the_null_one_then_fails_naming_the_request():
    slots = make(num_slots=4)
    got = [slots.allocate(f"r{i}") for i in range(3)]
    assert sorted(got) == [1, 2, 3] and slots.num_free_slots == 0
    assert [slots.slot(f"r{i}") for i in range(3)] == got
    with pytest.raises(ValueError, match="no free state slot for request 'r3'"):
        slots.allocate("r3")
    with pytest.raises(ValueError, match="'r0' already holds a state slot"):
        slots.allocate("r0")
    assert plans(slots) == ([], [], [])  # new requests start from zero: nothing to move


def test_free_gives_the_slot_back_and_a_double_free_or_unknown_request_is_an_error():
    slots = make()
    slot = slots.allocate("a")
    slots.free("a")
    assert slots.num_free_slots == 4 and not slots.holds("a")
    with pytest.raises(ValueError, match="'a' holds no state slot"):
        slots.free("a")
    with pytest.raises(ValueError, match="'ghost' holds no state slot"):
        slots.free("ghost")
    with pytest.raises(ValueError, match="'ghost' holds no state slot"):
        slots.slot("ghost")
    assert slots.allocate("b") == slot  # recompute restarts in a fresh (here reused) slot


def test_fork_copies_the_parent_state_into_the_childs_own_slot():
    slots = make()
    parent = slots.allocate("p")
    plans(slots)
    child = slots.fork("p", "c")
    grandchild = slots.fork("c", "g")  # reads what the child will read: the parent's slot
    assert len({parent, child, grandchild}) == 3
    assert plans(slots) == ([], [(parent, child), (parent, grandchild)], [])
    assert plans(slots) == ([], [], [])  # drained
    with pytest.raises(ValueError, match="cannot fork into 'c': it already holds a state slot"):
        slots.fork("p", "c")
    with pytest.raises(ValueError, match="'nobody' holds no state slot"):
        slots.fork("nobody", "x")


def test_a_slot_given_back_and_handed_out_again_still_reads_its_old_state():
    slots = make(num_slots=3)
    parent = slots.allocate("p")
    plans(slots)
    child = slots.fork("p", "c")
    slots.free("p")  # its slot is free at once ...
    assert slots.allocate("q") == parent  # ... and taken by a new request
    # The copy reads the parent's old state before the step writes q's from zero.
    assert plans(slots) == ([], [(parent, child)], [])
    with pytest.raises(ValueError, match="no free state slot"):
        slots.fork("c", "d")


def test_a_child_handed_its_parents_freed_slot_needs_no_copy():
    slots = make(num_slots=3)
    parent = slots.allocate("p")
    plans(slots)
    slots.fork("p", "c")
    slots.free("p")
    assert slots.fork("c", "g") == parent  # it reads that slot's old state: already there
    assert plans(slots)[1] == [(parent, slots.slot("c"))]


def test_swap_out_and_in_move_the_state_through_a_host_slot():
    slots = make(num_host_slots=1)
    slot = slots.allocate("a")
    plans(slots)
    assert slots.can_swap_out("a")
    host = slots.swap_out("a")
    assert slots.num_free_slots == 4 and slots.num_free_host_slots == 0
    with pytest.raises(ValueError, match="'a' is swapped out"):
        slots.slot("a")
    assert plans(slots) == ([(slot, host)], [], [])
    new_slot = slots.swap_in("a")  # any free slot
    assert slots.num_free_host_slots == 0  # read by this step's swap-in: held until take
    assert plans(slots) == ([], [], [(host, new_slot)])
    assert slots.num_free_host_slots == 1
    with pytest.raises(ValueError, match="'a' is not swapped out"):
        slots.swap_in("a")


def test_swap_out_needs_a_host_slot():
    slots = make(num_host_slots=0)
    slots.allocate("a")
    assert not slots.can_swap_out("a")
    with pytest.raises(ValueError, match="no host state slot"):
        slots.swap_out("a")


def test_swap_in_needs_a_free_slot():
    slots = make(num_slots=2)
    slots.allocate("a")
    slots.swap_out("a")
    slots.allocate("b")
    assert not slots.can_swap_in()
    with pytest.raises(ValueError, match="no free state slot for request 'a'"):
        slots.swap_in("a")


def test_swapped_in_then_out_in_one_step_keeps_its_host_slot_and_moves_nothing():
    slots = make()
    slots.allocate("a")
    host = slots.swap_out("a")
    plans(slots)
    slots.swap_in("a")
    assert slots.swap_out("a") == host
    assert plans(slots) == ([], [], [])


def test_a_fork_of_a_request_swapped_in_this_step_reads_the_host_slot_too():
    slots = make()
    slots.allocate("p")
    host = slots.swap_out("p")
    plans(slots)
    parent = slots.swap_in("p")
    child = slots.fork("p", "c")
    # Swap-ins run last: both read the host slot; neither may swap out again this step.
    assert not slots.can_swap_out("p") and not slots.can_swap_out("c")
    assert plans(slots) == ([], [], [(host, parent), (host, child)])
    assert slots.can_swap_out("c")


def test_a_swap_out_into_a_host_slot_freed_this_step_is_dropped():
    slots = make(num_host_slots=1)
    slots.allocate("a")
    slots.swap_out("a")
    slots.free("a")  # aborted while swapped out, before the runner ran the swap-out
    assert slots.num_free_host_slots == 1 and plans(slots) == ([], [], [])
    with pytest.raises(ValueError, match="'a' holds no state slot"):
        slots.free("a")

"""Backup state slots of speculative decoding (`StateBackups`, through `StateSlots`): the copy
before a verify step, dropping or reading it back after, release on free and swap, errors."""

from __future__ import annotations

import pytest

from jaxserve.core.state_backups import StateBackups, default_num_backup_slots
from jaxserve.core.state_slots import StateGroupSpec, StateSlots


def make(num_requests: int = 4, num_backups: int = 2, num_host_slots: int = 2) -> StateSlots:
    """Rows 1..num_requests - 1 for requests, then `num_backups` backup rows."""
    spec = StateGroupSpec(num_requests + num_backups, 64, num_backup_slots=num_backups)
    return StateSlots(spec, num_host_slots)


def moves(slots: StateSlots) -> tuple[list, list, list]:
    p = slots.take()
    return p.swap_out.pairs, p.copy.pairs, p.swap_in.pairs


def test_sizes_and_errors_name_the_field():
    assert default_num_backup_slots(8, speculating=True) == 8
    assert default_num_backup_slots(8, speculating=False) == 0
    spec = StateGroupSpec(9, 64, num_backup_slots=4)
    assert spec.num_request_slots == 5
    with pytest.raises(ValueError, match="num_backup_slots must be >= 0"):
        StateGroupSpec(5, 64, num_backup_slots=-1)
    with pytest.raises(ValueError, match="num_slots must be >= 2 .* besides num_backup_slots=4"):
        StateGroupSpec(5, 64, num_backup_slots=4)
    with pytest.raises(ValueError, match="first_slot must be >= 1"):
        StateBackups(0, 2)
    with pytest.raises(ValueError, match="num_backup_slots must be >= 0"):
        StateBackups(3, -1)


def test_requests_never_get_a_backup_row_and_backups_only_those():
    slots = make(num_requests=3, num_backups=2)
    assert slots.num_slots == 5 and slots.num_request_slots == 3
    assert sorted(slots.allocate(r) for r in "ab") == [1, 2]
    with pytest.raises(ValueError, match="no free state slot for request 'c' \\(all 2 held"):
        slots.allocate("c")
    assert sorted(slots.back_up(r) for r in "ab") == [3, 4]


def test_a_backup_is_a_copy_before_the_step_and_dropping_it_moves_nothing():
    slots = make()
    a = slots.allocate("a")
    moves(slots)
    assert slots.can_back_up("a")
    backup = slots.back_up("a")
    assert not slots.can_back_up("a")  # one backup per request
    with pytest.raises(ValueError, match="'a' already holds a backup"):
        slots.back_up("a")
    assert moves(slots) == ([], [(a, backup)], [])
    slots.drop_backup("a")  # every proposal held
    assert moves(slots) == ([], [], []) and slots.backups.num_free == 2
    assert slots.backups.num_backups == 1 and slots.backups.num_restores == 0


def test_a_restore_reads_the_backup_back_and_its_row_is_reusable_in_the_same_pass():
    slots = make()
    a, b = slots.allocate("a"), slots.allocate("b")
    backup = slots.back_up("a")
    moves(slots)  # the copy runs, then the verify step
    assert slots.restore_backup("a")
    assert slots.backups.num_free == 2 and slots.backups.num_restores == 1
    # The row goes to "b" at once: the copies gather before they scatter, so "a" reads the
    # backup before "b"'s state lands in it.
    assert slots.back_up("b") == backup
    assert moves(slots) == ([], [(backup, a), (b, backup)], [])
    with pytest.raises(ValueError, match="'a' holds no backup"):
        slots.restore_backup("a")


def test_a_restored_request_swapped_out_and_forked_reads_the_backup():
    slots = make()
    slots.allocate("a")
    backup = slots.back_up("a")
    moves(slots)
    slots.restore_backup("a")
    child = slots.fork("a", "a#1")
    host = slots.swap_out("a")
    assert moves(slots) == ([(backup, host)], [(backup, child)], [])


def test_a_backup_whose_copy_never_ran_is_cancelled():
    slots = make()
    slots.allocate("a")
    slots.back_up("a")
    assert not slots.restore_backup("a")  # nothing to read back: the state never moved
    assert moves(slots) == ([], [], []) and slots.backups.num_restores == 0


@pytest.mark.parametrize("how", ["free", "swap_out"])
def test_free_and_swap_out_give_the_backup_back(how):
    slots = make()
    a = slots.allocate("a")
    slots.back_up("a")
    getattr(slots, how)("a")
    assert slots.backups.num_free == 2 and not slots.backups.holds("a")
    out, copies, _ = moves(slots)
    assert copies == [] and out == ([(a, 0)] if how == "swap_out" else [])


def test_no_backup_for_a_state_swapped_in_this_pass_or_without_a_free_row():
    slots = make(num_backups=1)
    slots.allocate("a")
    slots.swap_out("a")
    moves(slots)
    slots.swap_in("a")
    assert not slots.can_back_up("a")  # its row is written after the copies
    with pytest.raises(ValueError, match="'a': its state is swapped in this step"):
        slots.back_up("a")
    moves(slots)
    slots.allocate("b")
    slots.back_up("a")
    assert not slots.can_back_up("b") and not slots.can_back_up("unknown")
    with pytest.raises(ValueError, match="no free backup state slot for request 'b'"):
        slots.back_up("b")
    with pytest.raises(ValueError, match="'x' holds no state slot"):
        slots.back_up("x")
    plain = make(num_backups=0)  # an engine that does not speculate
    plain.allocate("a")
    assert not plain.can_back_up("a")

"""The runner's kept block tables: deltas applied, padding zero, rows released, errors named."""

import numpy as np
import pytest

from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.runner.block_table_rows import BlockTableRows
from jaxserve.runner.step_input import build_step_arrays

W = 6  # table width


def entry(rid: str, pages: list[int], pages_from: int | None, start_pos: int = 0):
    return ScheduledRequest(rid, [5], start_pos, pages, 1, pages_from=pages_from)


def rows_of(rows: BlockTableRows, entries, num_rows: int = 4):
    table, lengths = rows.gather(entries, num_rows)
    assert table.shape == (num_rows, W) and table.dtype == np.int32
    assert not table[len(entries):].any()  # padded rows: the null page
    for i, n in enumerate(lengths):
        assert not table[i, n:].any()  # past each table: the null page
    return [table[i, :n].tolist() for i, n in enumerate(lengths)]


def test_deltas_build_the_whole_table():
    rows = BlockTableRows(W, num_rows=1)
    assert rows_of(rows, [entry("a", [3, 4], 0)]) == [[3, 4]]
    assert rows_of(rows, [entry("a", [], 2)]) == [[3, 4]]  # a decode within its page
    assert rows_of(rows, [entry("a", [9], 2)]) == [[3, 4, 9]]  # a page appended
    assert rows_of(rows, [entry("a", [7, 9], 1)]) == [[3, 7, 9]]  # copy-on-write at 1
    assert rows_of(rows, [entry("a", [], 1)]) == [[3]]  # trimmed: the rest is zeroed
    # a second request takes a row of its own (rows are added as needed)
    assert rows_of(rows, [entry("b", [8], 0), entry("a", [5], 1)]) == [[8], [3, 5]]
    assert rows.num_kept == 2


def test_whole_tables_built_by_hand_keep_nothing():
    rows = BlockTableRows(W, num_rows=2)
    assert rows_of(rows, [entry("x", [1, 2, 3, 4], None), entry("y", [6], None)]) == [
        [1, 2, 3, 4], [6]]
    assert rows.num_kept == 0
    # the scratch rows were cleared: a shorter table reads zeros past its end
    assert rows_of(rows, [entry("y", [2], None), entry("x", [5], None)]) == [[2], [5]]
    assert rows_of(rows, [entry("x", [4], 0), entry("z", [7, 7], None)]) == [[4], [7, 7]]
    assert rows.num_kept == 1


def test_release_forgets_a_row_and_a_later_delta_against_it_is_refused():
    rows = BlockTableRows(W, num_rows=2)
    rows_of(rows, [entry("a", [3, 4], 0), entry("b", [5], 0)])
    rows.release(["a", "unknown"])
    assert rows.num_kept == 1
    with pytest.raises(ValueError, match="'a'.*holds no table"):
        rows.gather([entry("a", [], 2)], 1)
    assert rows_of(rows, [entry("a", [6], 0)]) == [[6]]  # a whole table starts it again
    assert rows_of(rows, [entry("b", [], 1)]) == [[5]]


def test_released_rows_are_reused_so_the_table_stays_its_size():
    """A server runs requests without end: a released row goes back to the free list, so
    the table grows with the requests running at once, not with all ever served."""
    rows = BlockTableRows(W, num_rows=2)
    for i in range(100):  # two at a time, each for two steps
        a, b = f"a{i}", f"b{i}"
        assert rows_of(rows, [entry(a, [1 + i % 5], 0), entry(b, [2], 0)]) == [
            [1 + i % 5], [2]]
        assert rows_of(rows, [entry(a, [], 1), entry(b, [3], 1)]) == [[1 + i % 5], [2, 3]]
        rows.release([a, b])
        assert rows.num_kept == 0 and rows.num_free == len(rows.table) == 2
        assert not rows.table.any()  # released rows are zeroed


def test_bad_deltas_and_wide_tables_are_refused_by_name():
    rows = BlockTableRows(W, num_rows=1)
    with pytest.raises(ValueError, match="'w'.*7 pages exceeds max_pages_per_seq=6"):
        rows.gather([entry("w", list(range(1, 8)), None)], 1)
    with pytest.raises(ValueError, match="'w'.*7 pages exceeds"):
        rows.gather([entry("w", list(range(1, 8)), 0)], 1)
    rows_of(rows, [entry("a", [3], 0)])
    with pytest.raises(ValueError, match="'a'.*delta from page 3.*holds 1 pages"):
        rows.gather([entry("a", [9], 3)], 1)
    assert rows_of(rows, [entry("a", [9], 1)]) == [[3, 9]]  # the row is intact
    # a failed gather gave its scratch rows back (every row is kept or free)
    with pytest.raises(ValueError):
        rows.gather([entry("s", [1], None), entry("t", [1] * 9, None)], 2)
    assert rows.num_kept == 1 and len(rows._free) == len(rows.table) - 1
    assert not rows.table[[s for s in range(len(rows.table)) if s in rows._free]].any()


def test_random_deltas_match_the_tables_they_come_from():
    """Oracle: each step's tables held whole by the test; deltas from a diff of what was
    last sent (not the KV manager's bookkeeping)."""
    rng = np.random.default_rng(0)
    rows = BlockTableRows(W, num_rows=2)
    tables: dict[str, list[int]] = {}
    sent: dict[str, list[int]] = {}
    for step in range(300):
        released = []
        for rid in list(tables):
            op = rng.integers(6)
            if op == 0 and len(tables[rid]) < W:
                tables[rid].append(int(rng.integers(1, 50)))
            elif op == 1 and tables[rid]:
                tables[rid][int(rng.integers(len(tables[rid])))] = int(rng.integers(1, 50))
            elif op == 2:
                del tables[rid][int(rng.integers(len(tables[rid]) + 1)):]
            elif op == 3 and rng.random() < 0.3:
                del tables[rid]
                sent.pop(rid, None)
                released.append(rid)
        if len(tables) < 5:
            tables[f"r{step}"] = [int(x) for x in rng.integers(1, 50, rng.integers(1, W))]
        entries = []
        for rid, table in tables.items():
            old = sent.get(rid)
            start = 0
            if old is not None:
                while start < min(len(old), len(table)) and old[start] == table[start]:
                    start += 1
            entries.append(entry(rid, table[start:], start))
            sent[rid] = list(table)
        rows.release(released)
        assert rows_of(rows, entries, 8) == list(tables.values())
        assert rows.num_kept == len(tables)


def test_step_arrays_from_kept_rows_equal_those_from_whole_tables():
    rows = BlockTableRows(4, num_rows=1)
    whole = SchedulerOutput(scheduled=[ScheduledRequest("a", [5], 20, [3, 4], 1),
                                       ScheduledRequest("b", [6, 7], 0, [8], 1)])
    first = SchedulerOutput(scheduled=[ScheduledRequest("a", [5], 20, [3, 4], 1, pages_from=0),
                                       ScheduledRequest("b", [6, 7], 0, [8], 1, pages_from=0)])
    later = SchedulerOutput(scheduled=[ScheduledRequest("a", [5], 20, [], 1, pages_from=2),
                                       ScheduledRequest("b", [6, 7], 0, [], 1, pages_from=1)])
    ref = build_step_arrays(whole, 8, 4, 16, 4)
    for out in (first, later):
        got = build_step_arrays(out, 8, 4, 16, 4, tables=rows)
        for name, value in ref.device_tree().items():
            np.testing.assert_array_equal(got.device_tree()[name], value, err_msg=name)
    with pytest.raises(ValueError, match="width 4 for max_pages_per_seq=5"):
        build_step_arrays(later, 8, 4, 16, 5, tables=rows)
    with pytest.raises(ValueError, match="'a'.*holds no table"):
        build_step_arrays(later, 8, 4, 16, 4)  # a fresh runner holds no rows

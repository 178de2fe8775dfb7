"""`scripts/bench_page_layout.py`'s layouts: the same pages, only placed differently."""

import numpy as np
import pytest

from tests.bench import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("bench_page_layout")


@pytest.mark.parametrize("layout", ["contig", "interleaved", "runs4", "shuffled"])
def test_every_layout_uses_the_same_pages_once(script, layout):
    tables = script.page_ids(layout, 8, 12)
    assert tables.shape == (8, 12)
    assert sorted(tables.ravel().tolist()) == list(range(1, 97))


def test_layouts_place_pages_as_named(script):
    diffs = {name: np.diff(script.page_ids(name, 8, 12), axis=1)
             for name in ("contig", "interleaved", "runs4", "shuffled")}
    assert (diffs["contig"] == 1).all()
    assert (diffs["interleaved"] == 8).all()
    runs = diffs["runs4"][:, [0, 1, 2, 4, 5, 6, 8, 9, 10]]
    assert (runs == 1).all()  # inside each run of 4
    assert (diffs["shuffled"] == 1).mean() < 0.2


def test_step_rows_hold_their_tables(script):
    out = script.decode_step(4, 40, 16, "interleaved")
    assert [len(s.page_ids) for s in out.scheduled] == [3] * 4
    assert out.scheduled[1].page_ids == [2, 6, 10] and out.scheduled[1].start_pos == 40


@pytest.mark.parametrize("layout,message", [("runs5", "not runs of 5"), ("runs0", "unknown"),
                                            ("zigzag", "unknown layout")])
def test_bad_layouts_are_named(script, layout, message):
    with pytest.raises(ValueError, match=message):
        script.page_ids(layout, 8, 12)

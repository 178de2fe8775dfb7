"""The front page and the benchmark reference stay readable: README.md at most 250 lines with
no table cell over 300 characters, BENCHMARKS.md at most 800 lines (one current table per
topic; superseded runs live in git)."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def table_cells(text: str) -> list[tuple[int, str]]:
    """(line number, cell) of every markdown table cell in `text` (rows start with `|`)."""
    cells = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            cells += [(number, cell.strip()) for cell in line.strip().strip("|").split("|")]
    return cells


@pytest.mark.parametrize("name, most", [("README.md", 250), ("BENCHMARKS.md", 800)])
def test_length(name, most):
    lines = (ROOT / name).read_text().count("\n")
    assert lines <= most, f"{name} has {lines} lines (at most {most}: move detail to docs/)"


def test_readme_table_cells_are_short():
    long = [f"README.md:{n}: {len(c)} characters" for n, c in
            table_cells((ROOT / "README.md").read_text()) if len(c) > 300]
    assert not long, "\n".join(long)


def test_the_cell_reader_finds_cells():
    assert table_cells("x\n| a | bb |\n|---|---|\n") == [(2, "a"), (2, "bb"), (3, "---"),
                                                         (3, "---")]

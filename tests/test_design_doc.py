"""docs/design.md reads as a reference: no line longer than 200 characters (prose wraps near
92; a table whose cells would not fit becomes a list), and it cites public names only (no
backticked name with a private `_part`: a private helper is described by what it does and
the public function that runs it). That every cited name exists is
tests/test_design_names.py's check."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
MAX_LINE = 200
# A name part with one leading underscore (`_helper`, `Class._member`, `mod._name`, a path's
# `_file.py`), not a dunder (`__init__`, `__post_init__`) nor a word's inner underscore
# (`check_*_shapes`).
PRIVATE = re.compile(r"(?:^|[.\s/(,])_[A-Za-z0-9]")


def private_names(text: str) -> list[str]:
    """Backticked spans of `text` (fenced blocks included) that name a private part."""
    return sorted({span for span in re.findall(r"`([^`\n]+)`", text) if PRIVATE.search(span)})


def test_no_line_is_longer_than_200_characters():
    long = [f"line {i}: {len(line)} characters"
            for i, line in enumerate(DESIGN.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, "docs/design.md has lines over 200 characters:\n" + "\n".join(long)


def test_it_cites_no_private_name():
    found = private_names(DESIGN.read_text())
    assert not found, "docs/design.md cites private names:\n" + "\n".join(found)


def test_the_private_check_tells_private_from_public():
    text = ("`_helper` `Scheduler._pick` `models.moe._loop` `pkg/_impl.py` `__init__.py` "
            "`a.__post_init__` `x_y` `check_*_shapes` `{gate,up}_proj`")
    assert private_names(text) == ["Scheduler._pick", "_helper", "models.moe._loop",
                                  "pkg/_impl.py"]

"""Every `.py` under `scripts/` uses the package as a user would: read with the AST, no file
changes the import path (`sys.path`), imports a private name (`_name`) of `jaxserve`, `models`
or `pallas_kernels`, or reads a private attribute (`x._name`) of anything but `self`/`cls`;
and each starts with a docstring."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
PACKAGES = ("jaxserve", "models", "pallas_kernels")


def private(name: str) -> bool:
    """A single-underscore name (`_x`), not a dunder (`__x__`)."""
    return name.startswith("_") and not name.startswith("__")


def problems(source: str) -> list[str]:
    """What in `source` breaks the rules of the module docstring, one line each."""
    tree = ast.parse(source)
    found = []
    if ast.get_docstring(tree) is None:
        found.append("1: no module docstring")
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr == "path" \
                and isinstance(node.value, ast.Name) and node.value.id == "sys":
            found.append(f"{line}: sys.path (import the package, or `python -m` from the root)")
        elif isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] in PACKAGES:
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"{line}: imports private {node.module}: {p}" for p in parts if private(p)]
        elif isinstance(node, ast.Import):
            found += [f"{line}: imports private {a.name}" for a in node.names
                      if a.name.split(".")[0] in PACKAGES
                      and any(private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and private(node.attr) \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"{line}: private attribute .{node.attr}")
    return found


def script_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in SCRIPTS.rglob("*.py"))


def test_the_checker_sees_scripts():
    assert "scripts/examples/rl_update_weights.py" in script_files()
    assert len(script_files()) > 20


@pytest.mark.parametrize("path", script_files())
def test_script_is_hygienic(path):
    found = problems((ROOT / path).read_text())
    assert not found, f"{path}:\n" + "\n".join(found)


@pytest.mark.parametrize("source, bad", [
    ('"""Doc."""\nimport sys\nsys.path.insert(0, "x")\n', "sys.path"),
    ('"""Doc."""\nfrom jaxserve.runner.warmup import _dummy_rows\n', "imports private"),
    ('"""Doc."""\nfrom jaxserve._private import x\n', "imports private"),
    ('"""Doc."""\nimport models._hidden\n', "imports private"),
    ('"""Doc."""\nrunner._step_fn(1)\n', "private attribute ._step_fn"),
    ("x = 1\n", "no module docstring"),
])
def test_the_checker_finds(source, bad):
    assert any(bad in p for p in problems(source))


@pytest.mark.parametrize("source", [
    '"""Doc."""\nclass A:\n    def f(self):\n        return self._x, type(self).__name__\n',
    '"""Doc."""\nfrom jaxserve import LLM\nfrom numpy import _globals\nd = {"_cols": 1}\n',
])
def test_the_checker_allows(source):
    assert problems(source) == []

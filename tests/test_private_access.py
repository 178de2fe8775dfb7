"""No code reads another object's private attribute: in every module of `jaxserve/`,
`models/` and `pallas_kernels/`, `x._name` (one leading underscore, not a dunder) appears
only where `x` is `self` or `cls`, and `getattr`/`setattr`/`hasattr`/`delattr` never name
such an attribute of another object; the few third-party privates that cannot be avoided
are listed in `ALLOWED` with the reason."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "models", "pallas_kernels")
# A namedtuple's public API starts with an underscore so it cannot clash with a field.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# (module path, attribute) -> why it cannot be avoided.
ALLOWED = {
    # gguf's GGUFReader parses fields and tensors in private methods with no public hook:
    # `_CheckedReader` (its subclass) overrides them to read metadata arrays in one piece
    # and to check tensors against the file's size, and calls the base versions.
    ("models/loaders/gguf_file.py", "_get_field_parts"): "gguf.GGUFReader's own method",
    ("models/loaders/gguf_file.py", "_push_field"): "gguf.GGUFReader's own method",
    ("models/loaders/gguf_file.py", "_build_tensors"): "gguf.GGUFReader's own method",
    # jinja2's `namespace()` object keeps its attributes in a name-mangled dict and has no
    # public reader; the chat-template sandbox must size it to cap a template's output.
    ("jaxserve/entrypoints/template_sandbox.py", "_Namespace__attrs"):
        "jinja2.utils.Namespace's storage",
}
_NAME_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def _is_own(node: ast.expr) -> bool:
    """Whether `node` is `self` or `cls`."""
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private_accesses(source: str) -> list[tuple[int, str, str]]:
    """(line, attribute, expression) of every access to another object's private
    attribute in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) \
                and not _is_own(node.value):
            found.append((node.lineno, node.attr, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _NAME_FUNCTIONS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _is_private(node.args[1].value) and not _is_own(node.args[0])):
            found.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return found


def _modules() -> list[pathlib.Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_module_reads_another_objects_privates():
    offences, used = [], set()
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        for line, attr, expr in private_accesses(path.read_text()):
            if (rel, attr) in ALLOWED:
                used.add((rel, attr))
            else:
                offences.append(f"{rel}:{line}: {expr}")
    assert not offences, "private attributes of other objects read:\n" + "\n".join(offences)
    assert used == set(ALLOWED), f"stale ALLOWED entries: {sorted(set(ALLOWED) - used)}"


@pytest.mark.parametrize("source, expected", [
    ("self._x + cls._y", []),
    ("other._x", ["_x"]),
    ("self._inner._x", ["_x"]),
    ("super()._x()", ["_x"]),
    ("module._helper(1)", ["_helper"]),
    ("getattr(obj, '_x')", ["_x"]),
    ("setattr(self, '_x', 1); hasattr(obj, 'x')", []),
    ("obj.__dict__, obj.__len__()", []),
    ("point._replace(x=1)._asdict()", []),
    ("v._Namespace__attrs", ["_Namespace__attrs"]),
])
def test_the_check_flags_what_it_should(source, expected):
    assert [attr for _, attr, _ in private_accesses(source)] == expected

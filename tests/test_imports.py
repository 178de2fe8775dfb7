"""The package's import structure: no cycles between modules, a JAX-free core, and kernels and
models that know nothing of the engine (read from the source, so nothing is imported)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "models", "pallas_kernels")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports(path: pathlib.Path, known: set[str], top_level_only: bool) -> set[str]:
    """Project modules `path` imports (module-level statements only if `top_level_only`)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_no_import_cycles_between_modules():
    # NOTE: module-level imports, the ones that run at import time; function-level imports
    # are how a module defers a heavy dependency, and are checked for layering below.
    mods = modules()
    graph = {m: imports(p, set(mods), top_level_only=True) - {m} for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in graph[m]:
            if dep.startswith(m + ".") or m.startswith(dep + "."):
                continue  # a package and its own modules
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [m, dep])}")
            if dep not in state:
                visit(dep, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize("package, forbidden", [
    ("jaxserve.core", ("jax", "flax", "jaxlib", "pallas_kernels", "models")),
    ("pallas_kernels", ("jaxserve",)),
    ("models", ("jaxserve",)),
    ("jaxserve.bench", ("jaxserve.entrypoints",)),  # the CLI calls the library, not back
])
def test_layering(package, forbidden):
    for m, path in modules().items():
        if m != package and not m.startswith(package + "."):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else [])
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in forbidden), \
                    f"{m} imports {name}"


def test_every_package_says_what_it_is_for():
    for pkg in (ROOT / p for p in PACKAGES):
        for init in [pkg / "__init__.py", *pkg.rglob("*/__init__.py")]:
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and len(doc.split()) >= 5, f"{init.relative_to(ROOT)} has no purpose line"

"""The package's import structure: layers that import only downwards, no cycles between modules,
a JAX-free core, and kernels and models that know nothing of the engine (read from the
source, so nothing is imported)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "models", "pallas_kernels")
FACADE = "jaxserve"  # the public package `__init__`: it may import anything

# The layers, lowest first: a module may import modules of its own layer and of the layers
# below it, never of a layer above (function-level and TYPE_CHECKING imports included). An
# entry names a package (with all its modules) or a module; the facade names itself only.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The kernels and their metadata: plain JAX/Pallas, they know no model and no engine.
    ("kernels", ("pallas_kernels",)),
    # Model definitions and loaders: built on the kernels, they know nothing of serving.
    ("models", ("models",)),
    # The vocabulary every layer above speaks: configs (which name the models'
    # quantizations), requests, sampling and structured-output params, outputs, metrics
    # (read from outputs), images in requests (loaded, preprocessed, expanded) and small
    # utilities. No step is built or run here.
    ("base", ("jaxserve.utils", "jaxserve.compilation_cache", "jaxserve.config",
              "jaxserve.config_checks", "jaxserve.config_devices",
              "jaxserve.speculative_config",
              "jaxserve.request", "jaxserve.sampling_params", "jaxserve.structured",
              "jaxserve.outputs", "jaxserve.metrics", "jaxserve.lora",
              "jaxserve.pooling_params", "jaxserve.multimodal")),
    # The two independent halves of a step's logic: the host side (scheduler and KV
    # bookkeeping, JAX-free) and the device side's sampling math (per-row JAX functions).
    ("core+sample", ("jaxserve.core", "jaxserve.sample")),
    # Running a step on devices: meshes and shardings, the multi-host broadcast of device
    # calls, and the model runner (with its worker) built on them.
    ("parallel+runner", ("jaxserve.parallel", "jaxserve.runner")),
    # Proposers that wrap the runner (the draft model runs its own `ModelRunner`).
    ("spec_decode", ("jaxserve.spec_decode",)),
    # Engines: scheduler + runner + speculator + input/output processing, offline, async
    # and data-parallel.
    ("engine", ("jaxserve.engine",)),
    # What users run: the CLI, the HTTP server, batch runners and the benchmarks, and the
    # facade that re-exports the engine's API.
    ("entrypoints", ("jaxserve.entrypoints", "jaxserve.bench", FACADE)),
)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports(path: pathlib.Path, known: set[str]) -> dict[str, int]:
    """Project modules `path` imports, anywhere in it (module level, in functions, under
    TYPE_CHECKING), each with the line of its first import."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
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
                found[name] = min(found.get(name, node.lineno), node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """Every project module's imports of other modules: {importer: {imported: line}}."""
    mods = modules()
    graph = {m: imports(p, set(mods)) for m, p in mods.items()}
    for m, deps in graph.items():
        deps.pop(m, None)
    return graph


def layer_of(module: str) -> int | None:
    """Index in `LAYERS` of the entry that names `module` or its closest package."""
    best, best_len = None, -1
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            covers = module == e or (e != FACADE and module.startswith(e + "."))
            if covers and len(e) > best_len:
                best, best_len = i, len(e)
    return best


def describe(i: int) -> str:
    return f"layer {i}: {LAYERS[i][0]}"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for dep in sorted(graph[m]):
            if dep not in index:
                visit(dep)
                low[m] = min(low[m], low[dep])
            elif dep in on_stack:
                low[m] = min(low[m], index[dep])
        if low[m] == index[m]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycles_between_modules():
    # NOTE: every import counts, function-level and TYPE_CHECKING ones too: a deferred
    # import is still a dependency, and a cycle through one is a cycle.
    full = import_graph()
    graph = {m: {d for d in deps if not (d.startswith(m + ".") or m.startswith(d + "."))}
             for m, deps in full.items()}  # a package and its own modules do not count
    cycles = []
    for component in strongly_connected(graph):
        edges = [f"{m} -> {d} (line {full[m][d]})"
                 for m in component for d in sorted(graph[m]) if d in component]
        cycles.append(", ".join(component) + ":\n    " + "\n    ".join(edges))
    if cycles:
        pytest.fail("import cycles (the modules of each group import one another in a loop):\n  "
                    + "\n  ".join(cycles), pytrace=False)


def test_every_module_has_a_layer():
    missing = sorted(m for m in modules() if layer_of(m) is None)
    assert not missing, f"modules in no layer of tests/test_imports.py LAYERS: {missing}"


def test_layers_import_only_downwards():
    violations = []
    for m, deps in sorted(import_graph().items()):
        if m == FACADE:
            continue
        mine = layer_of(m)
        for dep, line in sorted(deps.items()):
            theirs = layer_of(dep)
            if mine is not None and theirs is not None and theirs > mine:
                violations.append(f"{m} ({describe(mine)}) imports {dep} ({describe(theirs)}), "
                                  f"line {line}")
    if violations:
        pytest.fail("imports of a higher layer (see LAYERS in tests/test_imports.py):\n  "
                    + "\n  ".join(violations), pytrace=False)


def test_layer_table_is_consistent():
    entries = [e for _, es in LAYERS for e in es]
    assert len(entries) == len(set(entries)), "a module or package in two layers"
    mods = modules()
    assert all(e in mods for e in entries), [e for e in entries if e not in mods]


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

"""docs/design.md names only what exists: every file path, `Class.member`, `module.name` and
code identifier it cites in backticks resolves in the source tree (read, not imported)."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SOURCE_DIRS = ("jaxserve", "models", "pallas_kernels", "scripts", "tests")
CODE_DIRS = ("jaxserve", "models", "pallas_kernels", "scripts")  # where names are defined
# A file (with its extension) or a folder (with a trailing slash), relative to the root,
# to `jaxserve/`, or a tail of a source file's path; `a/b` without either is a tree path.
PATH = re.compile(r"^[\w./-]+\.(py|cc|h|md|sh|toml)$|^[\w.-]+(/[\w.-]+)*/$")
DOTTED = re.compile(r"^([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)(\(.*\))?$")
IDENT = re.compile(r"^([a-z_][a-z0-9_]*_[a-z0-9_]*)(\(.*\))?$")


def cited() -> list[str]:
    """Backticked spans of design.md, outside fenced code blocks."""
    text = re.sub(r"```.*?```", "", DESIGN.read_text(), flags=re.S)
    return sorted(set(re.findall(r"`([^`\n]+)`", text)))


@functools.cache
def source_files() -> list[pathlib.Path]:
    return [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*") if p.is_file()]


@functools.cache
def code_words() -> frozenset[str]:
    """Every word (a maximal run of `\\w`) of the source files but this one: an identifier is
    named in the code when it is one of them, as `\\bname\\b` would find it.

    NOTE: a set rather than a regex search per identifier over the ~3.7 MB of code: ~850 searches
    took 12-17 s of the default tier."""
    return frozenset(word for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")
                     if p.resolve() != pathlib.Path(__file__).resolve()
                     for word in re.findall(r"\w+", p.read_text()))


@functools.cache
def parsed(path: pathlib.Path) -> ast.Module:
    """A source file's syntax tree, parsed once however many names it is asked for."""
    return ast.parse(path.read_text())


@functools.cache
def classes() -> dict[str, list[ast.ClassDef]]:
    """Every class of the code directories by name."""
    found: dict[str, list[ast.ClassDef]] = {}
    for d in CODE_DIRS:
        for p in (ROOT / d).rglob("*.py"):
            for node in ast.walk(parsed(p)):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(node)
    return found


def class_members(cls: ast.ClassDef) -> set[str]:
    """Methods, class attributes, dataclass fields and `self.x` assignments of a class,
    and those of its bases defined in the project."""
    names: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else None
        for parent in classes().get(name, []):
            names |= class_members(parent)
    return names


def module_path(dotted: str) -> pathlib.Path | None:
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_defines(path: pathlib.Path, name: str) -> bool:
    for node in ast.walk(parsed(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name == name:
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) \
                and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def problem(span: str) -> str | None:
    """Why `span` does not resolve, or None when it does (or is not a code name)."""
    span = span.strip()
    if " " in span or span.startswith(("-", "jaxserve:", "/", "~", ".")):
        return None  # prose, flags, metric names, absolute or home paths
    if PATH.match(span):
        rel = span.rstrip("/")
        if (ROOT / rel).exists() or (ROOT / "jaxserve" / rel).exists() \
                or any(str(p).endswith("/" + rel) for p in source_files()):
            return None
        return "no such file"
    m = DOTTED.match(span)
    if m:
        head, rest = m.group(1), m.group(2)[1:].split(".")
        if head in classes():
            member = rest[0]
            if any(member in class_members(c) for c in classes()[head]):
                return None
            return f"class {head} has no member {member!r}"
        for i in range(len(rest), -1, -1):  # the longest prefix that is a module
            mod = module_path(".".join([head, *rest[:i]]))
            if mod is not None:
                if i == len(rest) or module_defines(mod, rest[i]):
                    return None
                return f"{mod.relative_to(ROOT)} defines no {rest[i]!r}"
        return None  # a variable's attribute (`config.cache`), or another library's
    m = IDENT.match(span)
    if m and m.group(1) not in code_words():
        return "named nowhere in the code"
    return None


def test_design_names_resolve():
    bad = [f"`{span}`: {why}" for span in cited() if (why := problem(span)) is not None]
    assert len(cited()) > 300  # the checker reads the document
    assert not bad, "docs/design.md cites names that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("span, resolves", [
    ("LLMEngine.add_request", True), ("LLMEngine.no_such_method", False),
    ("jaxserve/core/scheduler.py", True), ("engine/request_state.py", False),
    ("models.linear.serving_form", True), ("models.linear.nope", False),
    ("tokenize_prompt", False), ("resolve_limits", True), ("prompt_targets", True),
    ("lm_head/kernel", True),  # a parameter path, not a file
])
def test_the_checker_tells_names_that_exist(span, resolves):
    assert (problem(span) is None) == resolves

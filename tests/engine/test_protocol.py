"""The engine interface (`EngineClient`): every engine kind provides all of it, and the layers
above read nothing of an engine by probing (`getattr`)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.protocol import EngineClient
from tests.entrypoints.fake_engine import FakeEngine

ROOT = pathlib.Path(__file__).resolve().parents[2]


def protocol_members() -> set[str]:
    names = {n for n in vars(EngineClient) if not n.startswith("_")}
    return names | set(EngineClient.__annotations__)


@pytest.mark.parametrize("engine_class", [LLMEngine, DataParallelEngine, FakeEngine])
def test_every_engine_kind_has_the_whole_interface(engine_class):
    init_attrs = {node.attr for node in ast.walk(ast.parse(
        pathlib.Path(__import__(engine_class.__module__, fromlist=["_"]).__file__).read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id == "self"}
    missing = {m for m in protocol_members()
               if not hasattr(engine_class, m) and m not in init_attrs}
    assert not missing, f"{engine_class.__name__} lacks {sorted(missing)}"


def test_a_fake_engine_is_an_engine_client():
    assert isinstance(FakeEngine(), EngineClient)
    assert not isinstance(object(), EngineClient)


def test_nothing_probes_an_engine_with_getattr():
    """`getattr(<engine>, ...)` outside the engine package means a member the interface
    lacks: add it to `EngineClient` instead."""
    offenders = []
    for path in (ROOT / "jaxserve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0])
                if "engine" in target.split(".")[-1] or target.endswith(".engine"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}")
    assert not offenders, offenders

"""`scripts/bench_second_engine.py` on the tiny model: the second engine compiles nothing
and gives the first one's tokens."""

import collections
import importlib.util
import os

from jaxserve.runner import model_runner

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts",
                      "bench_second_engine.py")


def test_second_engine_compiles_nothing(tiny_model_dir, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_second_engine", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # (programs of earlier engines in this process would leave the first nothing to compile)
    monkeypatch.setattr(model_runner, "PROGRAMS", collections.OrderedDict())
    first, second = script.run(tiny_model_dir, max_num_batched_tokens=32, max_model_len=128)
    assert first["compilations"] > 0 and second["compilations"] == 0
    assert second["tokens"] == first["tokens"] and len(first["tokens"][0]) == 8

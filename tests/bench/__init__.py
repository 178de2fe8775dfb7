"""Benchmark tests; `load_script` imports a `scripts/` file as a module."""

import importlib.util
import os
import sys

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")


def load_script(name: str):
    """`scripts/<name>.py` imported as a module (the scripts folder put on `sys.path`
    first, for the scripts that import each other)."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""Counts JAX compilations (jit cache misses) in this process through `jax.monitoring`.

A cache miss traces and lowers the function, whether or not the persistent cache then
supplies the binary, so lowering events are what "a compilation" means here.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def install() -> None:
    """Registers the listener once per process."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def num_compilations() -> int:
    """Compilations since `install()`."""
    return _count

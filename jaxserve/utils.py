"""Small helpers with no dependencies (no JAX), shared by the host-side code."""

from __future__ import annotations

import functools
import json
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many units of size `b` (> 0) hold `a` items.

    Works elementwise on NumPy integer arrays as well.
    """
    return -(-a // b)


def delegated(part: str, method: Callable) -> Callable:
    """A method that calls `method` on the object's collaborator `self.<part>`, with the
    method's name, signature and docstring: how a class composed of collaborators keeps
    their calls as its own public API (`LLMEngine.sleep` is its `WeightControl`'s).

    Args:
        part: The attribute holding the collaborator (dotted for a nested one).
        method: The collaborator class's function of the same name.
    """
    get_part = operator.attrgetter(part)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return getattr(get_part(self), method.__name__)(*args, **kwargs)

    return call


def delegated_property(part: str, prop: property) -> property:
    """A read-only property that reads `prop` of the object's collaborator `self.<part>`
    (its docstring kept)."""
    return property(operator.attrgetter(f"{part}.{prop.fget.__name__}"), doc=prop.__doc__)


def _load_malloc_trim():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()


def trim_memory() -> None:
    """Gives the C heap's free memory back to the system (glibc's `malloc_trim`; a no-op
    elsewhere). Freed blocks below glibc's mmap threshold stay resident in the
    allocator's arenas: a multi-megabyte request body, the host copies of weights while
    loading, compile temporaries. Without this the process's RSS only ever grows."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def split_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of "host:port" (or "[v6 address]:port"); None when it is not that form."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return (host, int(port)) if host and port.isdigit() else None


def wait_for_listener(host: str, port: int, timeout: float, what: str, hint: str) -> None:
    """Waits until something accepts TCP connections at host:port (it may start later).

    Raises:
        ValueError: Nothing answered within `timeout` seconds; the message names `what`
            and adds `hint`.
    """
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ValueError(f"{what} {host}:{port} did not answer within {timeout:g} s "
                                 f"({e}); {hint}") from None
        time.sleep(0.2)


def settings_dict(value: Any, name: str, known: Iterable[str], example: str = "",
                  allow_json: bool = True) -> dict:
    """A settings object's fields given as a dict (or, with `allow_json`, its JSON text, as
    a CLI flag takes it), checked against the `known` field names: the one parser behind
    `--speculative-config`, `--pooler-config` and `structured_outputs`.

    Raises:
        ValueError: Text that is not JSON, not a dict, or unknown fields; each message
            starts with `name`.
    """
    if isinstance(value, str) and allow_json:
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a dict{' such as ' + example if example else ''}"
                         f", got {type(value).__name__}")
    known = set(known)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {unknown}; known: {sorted(known)}")
    return value


def named_choice(registry: Mapping[str, T], name: str, what: str) -> T:
    """`registry[name]`: the one lookup behind the named parsers (`--tool-call-parser`,
    `--reasoning-parser`).

    Args:
        registry: The choices by name.
        name: The name asked for.
        what: What the names name, for the error ("tool call parser").

    Returns:
        The entry named `name`.

    Raises:
        ValueError: An unknown name; the message names `what` and the choices.
    """
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}: choose from {', '.join(sorted(registry))}")
    return registry[name]

"""Small helpers with no dependencies (no JAX), shared by the host-side code."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many units of size `b` (> 0) hold `a` items.

    Works elementwise on NumPy integer arrays as well.
    """
    return -(-a // b)


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

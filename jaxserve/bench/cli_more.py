"""The remaining `jaxserve bench` subcommands and `jaxserve diagnose` (parsers and handlers)."""

from __future__ import annotations


def add_commands(bsub, sub) -> None:
    """Adds latency, serve, roofline, scale, overhead, simulate and `diagnose`."""

"""Turns on JAX's persistent compilation cache so later processes skip recompiles."""

from __future__ import annotations

import os

import jax

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "jax")


def enable_compilation_cache(cache_dir: str | None = None) -> str:
    """Enables the persistent cache for every compile, however small.

    NOTE: JAX's default 1 s minimum compile time would skip most of our step functions,
    so both thresholds are dropped.

    Args:
        cache_dir: Where to keep compiled programs; defaults to ~/.cache/jaxserve/jax.

    Returns:
        The cache directory in use.
    """
    cache_dir = cache_dir or DEFAULT_CACHE_DIR
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return cache_dir

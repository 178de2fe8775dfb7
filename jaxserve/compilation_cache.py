"""Turns on JAX's persistent compilation cache so later processes skip recompiles, and
drops JAX's in-memory staging caches once warm-up has compiled what serving runs."""

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


def drop_staging_caches() -> bool:
    """Frees JAX's tracing and lowering caches (jaxprs, MLIR modules and their Python-side
    executable cache) once warm-up has compiled every program serving runs.

    Each jitted function keeps its compiled executables in its own C++ dispatch cache,
    which this leaves alone: the warmed programs dispatch as before, with no tracing and
    no compilation (a signature never compiled traces anew, as it would anyway). After the
    default model's warm-up this gave back ~77 MB (BENCHMARKS.md, issue 49's memory).

    Returns:
        Whether there was something to call: the caches are JAX internals
        (`jax._src.util.clear_all_caches`, which `jax.clear_caches` calls before it also
        empties the dispatch caches); a JAX without it keeps them.
    """
    from jax._src import util

    clear = getattr(util, "clear_all_caches", None)
    if clear is None:
        return False
    clear()
    return True

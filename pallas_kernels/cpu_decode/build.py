"""Compiles `paged_decode.cc` with the system C++ compiler into a cached shared library.

The library is built once per source, flags and jaxlib version (the FFI headers come with
jaxlib) under ~/.cache/jaxserve/ffi (or $JAXSERVE_FFI_CACHE), written to a temporary name
and renamed into place, so processes building at once never load a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import jax
import jaxlib

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "paged_decode.cc")
# NOTE: -march=native: the library is built on the machine that runs it (the cache key
# holds the host's CPU flags); -ffast-math lets the compiler vectorize the dot products'
# and sums' reductions (keys are never inf or NaN: masked keys are never read).
FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cache_dir() -> str:
    """Where built libraries are kept."""
    return os.environ.get("JAXSERVE_FFI_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxserve", "ffi")


def library_path(compiler: str) -> str:
    """The cached library's path for this source, compiler, flags, jaxlib and CPU."""
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read())
    for part in (compiler, " ".join(FLAGS), jaxlib.__version__, _cpu_flags()):
        key.update(part.encode())
    return os.path.join(cache_dir(), f"paged_decode-{key.hexdigest()[:16]}.so")


def build() -> ctypes.CDLL:
    """The loaded library, compiled first if no cached build exists.

    Raises:
        RuntimeError: No C++ compiler ($CXX, else g++, else c++) or the compile failed;
            the message carries the compiler's output.
    """
    name = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    compiler = shutil.which(name) if name else None
    if compiler is None:
        raise RuntimeError(f"no C++ compiler found (CXX={os.environ.get('CXX')!r}, "
                           "g++ and c++ not on PATH)")
    path = library_path(compiler)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", SOURCE, "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building the CPU decode kernel failed ({' '.join(cmd)}):\n"
                                   f"{proc.stderr[-2000:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        logger.info("jaxserve: built the CPU decode kernel: %s", path)
    return ctypes.CDLL(path)

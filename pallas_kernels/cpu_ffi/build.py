"""Compiles `paged_decode.cc` (or another FFI source) with the system C++ compiler into a
cached shared library.

The library is built once per source (with the headers beside it, `pool.h`), flags and
jaxlib version (the FFI headers come with jaxlib) under ~/.cache/jaxserve/ffi (or
$JAXSERVE_FFI_CACHE), written to a temporary name and renamed into place, so processes
building at once never load a half-written file.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile

import jax
import jaxlib

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "paged_decode.cc")
# NOTE: -march=native: the library is built on the machine that runs it (the cache key
# holds the host's CPU flags); -ffast-math lets the compiler vectorize the sums and exp
# (masked keys are never read, so no inf or NaN enters them). Compiled and linked apart:
# GCC links `-ffast-math -shared` with crtfastmath.o, whose constructor would turn on
# flush-to-zero for the whole process (NumPy and torch included) when the library loads.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC"]
LINK_FLAGS = ["-shared"]
BUILD_TIMEOUT_S = 600


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


def library_path(compiler: str, source: str = SOURCE) -> str:
    """The cached library's path for `source` and the shared headers, compiler, flags,
    jaxlib and CPU."""
    key = hashlib.sha256()
    headers = sorted(f for f in os.listdir(HERE) if f.endswith(".h"))
    for path in [source, *(os.path.join(HERE, h) for h in headers)]:
        with open(path, "rb") as f:
            key.update(f.read())
    for part in (compiler, " ".join(FLAGS + LINK_FLAGS), jaxlib.__version__, _cpu_flags()):
        key.update(part.encode())
    stem = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(cache_dir(), f"{stem}-{key.hexdigest()[:16]}.so")


def _run(cmd: list[str], what: str) -> None:
    """Runs one compiler command; RuntimeError with its output if it fails or hangs."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"building {what} timed out after "
                           f"{BUILD_TIMEOUT_S} s ({' '.join(cmd)})") from e
    if proc.returncode != 0:
        raise RuntimeError(f"building {what} failed ({' '.join(cmd)}):\n"
                           f"{proc.stderr[-2000:]}")


def build(source: str = SOURCE, what: str = "the CPU decode kernel") -> ctypes.CDLL:
    """The loaded library of `source` (default: the CPU decode kernel), compiled first if
    no cached build exists; `what` names it in errors and logs.

    The source uses GCC's vector extensions (`__builtin_shuffle`): $CXX (a command, e.g.
    "ccache g++") else g++ else c++ must be GCC-compatible; Clang fails to build it and
    the engine keeps the XLA path.

    Raises:
        RuntimeError: No C++ compiler, or the compile failed or timed out; the message
            carries the compiler's output.
    """
    cxx = shlex.split(os.environ.get("CXX", "")) or [shutil.which("g++") or "c++"]
    found = shutil.which(cxx[0])
    if found is None:
        raise RuntimeError(f"no C++ compiler found (CXX={os.environ.get('CXX')!r}, "
                           "g++ and c++ not on PATH)")
    compiler = [found, *cxx[1:]]
    path = library_path(" ".join(compiler), source)
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # NOTE: processes starting together (test workers, data-parallel replicas) build a
        # library once: the others wait on its lock, then load the first one's build.
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(path):
                _compile(compiler, source, path, what)
    return ctypes.CDLL(path)


def _compile(compiler: list[str], source: str, path: str, what: str) -> None:
    """Compiles `source` into the shared library `path` (written whole, then renamed)."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        _run([*compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HERE}", "-c", source,
              "-o", obj], what)
        _run([*compiler, *LINK_FLAGS, obj, "-o", tmp], what)
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.remove(leftover)
    logger.info("jaxserve: built %s: %s", what, path)


def register(source: str, symbol: str, target: str, what: str, fallback: str) -> str | None:
    """Builds `source` and registers its handler `symbol` as the CPU FFI target `target`.

    Returns:
        None, or why it failed (logged as a warning: "`what` is unavailable, `fallback`").
    """
    try:
        lib = build(source, what)
    except (RuntimeError, OSError) as e:
        logger.warning("jaxserve: %s is unavailable, %s: %s", what, fallback, e)
        return str(e)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                platform="cpu")
    return None

"""The process-wide memory settings the CLI makes (issue 49 item 2): glibc's arena cap,
observed in glibc's own report (`malloc_info`) of a fresh process whose threads allocate
at once; the user's `MALLOC_ARENA_MAX` left alone; a bad cap refused."""

import os
import subprocess
import sys

import pytest

from jaxserve import utils

pytestmark = pytest.mark.skipif(utils._MALLOC_TRIM is None, reason="needs glibc")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Four threads allocate and wait for each other (so none takes over an exited one's
# arena); then glibc's XML report is counted for its heaps (arenas).
SCRIPT = """
import ctypes, ctypes.util, sys, tempfile, threading
from jaxserve.utils import limit_malloc_arenas
print(limit_malloc_arenas(int(sys.argv[1])) if sys.argv[1] != "none" else None)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = libc.fopen.restype = ctypes.c_void_p
together = threading.Barrier(4)
def work():
    libc.malloc(4096)
    together.wait()
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
with tempfile.NamedTemporaryFile("r") as out:
    f = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    print(out.read().count("<heap nr="))
"""


def _arenas(cap: str, **env) -> tuple[str, int]:
    env = {**{k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"},
           "PYTHONPATH": ROOT, **env}
    out = subprocess.run([sys.executable, "-c", SCRIPT, cap], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


def test_the_cap_holds_the_threads_to_its_arenas():
    assert _arenas("none")[1] >= 3  # glibc's default: an arena per new thread
    assert _arenas("1") == ("True", 1)
    assert _arenas("2") == ("True", 2)


def test_the_users_malloc_arena_max_stands():
    assert _arenas("1", MALLOC_ARENA_MAX="3") == ("False", 3)


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="arenas must be at least 1, got 0"):
        utils.limit_malloc_arenas(0)

"""`scripts/profile_step.py`: a bad `--chunk` is refused before any model loads."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "profile_step.py")


@pytest.mark.parametrize("args", [["--chunk", "300"], ["--chunk", "-4"],
                                  ["--chunk", "256", "--context-len", "900"]])
def test_a_bad_chunk_is_a_usage_error(args):
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "--chunk takes 1-256 tokens" in proc.stderr

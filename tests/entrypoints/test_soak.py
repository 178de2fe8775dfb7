"""`scripts/benchmarks/soak.py` for two minutes on the tiny model (slow tier): a real server under
the mixed load, then every check of the soak (answers, probe outputs, KV, scheduler, memory,
compiles)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CACHE_DIR = os.environ.get("JAXSERVE_TEST_CACHE", os.path.join(ROOT, ".jax_cache"))


@pytest.mark.slow  # two minutes of load, by design
def test_two_minute_soak_passes_every_check(tiny_model_dir, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.benchmarks.soak", "--minutes", "2", "--model",
         tiny_model_dir, "--json", str(out), "--server-args",
         f"--compilation-cache-dir {CACHE_DIR}"],
        capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, (failed, report["failures"], report)
    assert proc.returncode == 0
    # The load was mixed: every kind of request was sent, and the good ones were many.
    for kind in ("bad", "left", "aborted", "structured", "choice", "tokenize"):
        sent = sum(n for name, n in report["sent"].items() if name.split()[0] == kind)
        assert sent > 0, (kind, report["sent"])
    assert sum(report["answered"].values()) > 100

"""`scripts/benchmarks/bench_sampler.py`: two checkouts' samplers in one process, one table
row each."""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_compares_two_checkouts_and_names_bad_cases():
    args = [sys.executable, "-m", "scripts.benchmarks.bench_sampler", "--before", ROOT,
            "--rows", "4", "--vocab-size", "300", "--rounds", "1", "--iters", "1"]
    out = subprocess.run(args + ["--cases", "greedy,t0.8-p0.95"], capture_output=True,
                         text=True, timeout=300, check=True, cwd=ROOT).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 4 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["greedy", "t0.8-p0.95"]
    for r in rows:  # before ms, now ms, now / before
        assert all(float(c) > 0 for c in r.split("|")[3:6])
    bad = subprocess.run(args + ["--cases", "nucleus"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "unknown cases ['nucleus']" in bad.stderr

"""Benchmarks, each run from the repository root as `python -m scripts.benchmarks.NAME`.

BENCHMARKS.md gives each one's current figures with the exact command, machine and date.
"""

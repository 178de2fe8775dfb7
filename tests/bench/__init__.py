"""Benchmark tests: the `jaxserve bench` commands, `scripts/benchmarks/` and `scripts/examples/`.

The scripts are imported as modules of the repository (`from scripts.benchmarks import
bench_qgemm`; the repository root is on the import path under pytest).
"""

"""The project's scripts: benchmarks, worked examples and the accelerator check.

`scripts.benchmarks` holds the benchmarks (`python -m scripts.benchmarks.NAME`; figures and
commands in BENCHMARKS.md), `scripts.examples` the worked examples of the Python API
(`python -m scripts.examples.NAME`), and `device_check.sh` the prepared check for a lent
GPU or TPU machine (with `device_kernel_check.py`, which it runs).
"""

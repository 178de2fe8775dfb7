"""Worked examples of the Python API, each run as `python -m scripts.examples.NAME`.

`tests/bench/test_examples.py` runs every one on the tiny random model of the tests.
"""

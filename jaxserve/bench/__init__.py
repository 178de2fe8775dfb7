"""Benchmark library the `jaxserve bench` commands call: traces, engine and serving runs,
baselines, roofline, overhead, scale, statistics, reports, plots, the scheduler simulator
and the diagnosis."""

"""Benchmark building blocks: synthetic traces, latency statistics, the scheduler simulator."""

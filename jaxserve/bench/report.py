"""Plain-text tables and `vllm bench serve`-style result blocks for the benchmark commands."""

from __future__ import annotations

import json
import math


def fmt(value, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, str):
        return value
    return format(value, spec)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A Markdown table: `columns` are (key, header, format spec)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    body = ["| " + " | ".join(fmt(r.get(k), spec) for k, _, spec in columns) + " |"
            for r in rows]
    return "\n".join([head, rule, *body])


# (key, label) in the order `vllm bench serve` prints them.
SERVE_LINES = [
    ("completed", "Successful requests:", "d"),
    ("duration", "Benchmark duration (s):", ".2f"),
    ("total_input_tokens", "Total input tokens:", "d"),
    ("total_output_tokens", "Total generated tokens:", "d"),
    ("request_throughput", "Request throughput (req/s):", ".2f"),
    ("request_goodput", "Request goodput (req/s):", ".2f"),
    ("output_throughput", "Output token throughput (tok/s):", ".2f"),
    ("total_token_throughput", "Total Token throughput (tok/s):", ".2f"),
]


def serve_block(res: dict, title: str = "Serving Benchmark Result") -> str:
    """The result block in `vllm bench serve`'s layout (same labels and metric names)."""
    lines = [f"{' ' + title + ' ':=^50}"]
    for key, label, spec in SERVE_LINES:
        if key in res and res[key] is not None:
            lines.append(f"{label:<40}{fmt(res[key], spec):<10}")
    for name, head in (("ttft", "Time to First Token"),
                       ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + head + ' ':-^50}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            key = f"{stat}_{name}_ms"
            if key in res:
                lines.append(f"{label + ' ' + name.upper() + ' (ms):':<40}"
                             f"{fmt(res[key], '.2f'):<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def dump_json(path: str | None, obj) -> None:
    """Writes `obj` as JSON (no-op for None)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=float)

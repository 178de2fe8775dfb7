"""Matplotlib PNGs of benchmark results: throughput by mode, latency CDFs, a run's timeline.

Needs the `bench` extra (matplotlib); the Agg backend is used, so no display is needed.
Each function returns the paths it wrote.
"""

from __future__ import annotations

import os

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _itls(run: dict) -> list[float]:
    out = []
    for r in run["requests"]:
        t = r["token_times"]
        out.extend(1000 * (b - a) for a, b in zip(t, t[1:], strict=False))
    return out


def _ttfts(run: dict) -> list[float]:
    return [1000 * (r["token_times"][0] - r["arrival"]) for r in run["requests"]
            if r["token_times"]]


def plot_modes(results: dict, out_dir: str) -> list[str]:
    """throughput_by_mode.png, latency_cdf.png and timeline_<mode>.png (the chunked run)."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    names = list(results)
    out = [results[n]["summary"]["output_throughput"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(range(len(names)), out, color=["#888" if "transformers" in n else "#3a7"
                                                 for n in names])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput by scheduling mode (same trace, same run)")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "throughput_by_mode.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in names:
        run = results[name].get("run")
        if run is None:
            continue
        for ax, values in ((axes[0], _ttfts(run)), (axes[1], _itls(run))):
            x = np.sort(values)
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=name)
    for ax, title in ((axes[0], "TTFT"), (axes[1], "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if title == "TTFT" else "fraction of gaps")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "latency_cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for name in names:
        if "run" in results[name] and name == "continuous+chunked":
            paths.append(plot_timeline(results[name]["run"], name, out_dir))
    return paths


def plot_timeline(run: dict, name: str, out_dir: str) -> str:
    """KV usage, batch size and waiting requests per step over time for one run."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    steps = run["steps"]
    t = [s["t"] for s in steps]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.step(t, [s["num_seqs"] for s in steps], where="post", label="batch size (requests)")
    ax.step(t, [s["num_waiting"] for s in steps], where="post", label="waiting requests")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests")
    ax2 = ax.twinx()
    ax2.plot(t, [100 * s["kv_usage"] for s in steps], color="C3", label="KV pages used %")
    ax2.set_ylabel("KV usage %")
    ax2.set_ylim(0, 100)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper right")
    ax.set_title(f"KV usage and batch size over time: {name}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"timeline_{name.replace('+', '_')}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scale(rows: list[dict], x: str, out_dir: str, name: str) -> str:
    """Throughput and peak memory against `x` (concurrency or context)."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = [r[x] for r in rows]
    ax.plot(xs, [r["output_throughput"] for r in rows], "o-", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["peak_rss_mib"] for r in rows], "s--", color="C3", label="peak RSS MiB")
    ax2.set_ylabel("peak host RSS (MiB)")
    fig.legend(fontsize=8, loc="upper left")
    ax.set_title(f"Cost of scale: {x}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

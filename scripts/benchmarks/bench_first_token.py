"""Time to first token of a one-line prompt in `jaxserve generate` (and `--chat`), as a user
sees it: a fresh process on a warm compilation cache, the GGUF's blocks served in place (the
CPU default for the embedded GGUF) against float32 (`--quantization none`).

Each round runs every variant once as a subprocess (`python -m jaxserve.entrypoints.cli
generate PROMPT --max-tokens 1 ...`), the order reversed every other round, after one
unrecorded round that fills the compilation cache. Printed per variant: the median of the
process's wall time (start to exit), and of what the CLI itself reports on stderr: the
engine's load + set-up time and the first token's latency from the request's arrival; the
remainder (wall - load - first token) is Python start, imports and exit. The load average
is printed beside every round.

Usage: python -m scripts.benchmarks.bench_first_token [--rounds 3] [--prompt TEXT] [--chat]
       [--variants "default;--quantization none"] [--llama-cli PATH]

`--llama-cli` adds llama.cpp's `llama-cli` on the same file as a variant (one turn, one
token, 2 threads: `-st -n 1`; it applies the chat template, so compare it with `--chat`),
timed by its wall time alone (it reports no split).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

_REPORT = re.compile(r"load \+ warm-up ([\d.]+)s, .* first token (\d+) ms")


def run_once(prompt: str, extra: list[str], chat: bool) -> tuple[float, float, float]:
    """(wall s, load s, first-token ms) of one `jaxserve generate` process.

    Raises:
        RuntimeError: The process failed or printed no timing line.
    """
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "generate", prompt,
           "--max-tokens", "1", *(["--chat"] if chat else []), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    m = _REPORT.search(proc.stderr)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-1500:]}")
    return wall, float(m[1]), float(m[2])


def run_llama_cli(binary: str, prompt: str) -> tuple[float, float, float]:
    """(wall s, nan, nan) of one `llama-cli` process on the default GGUF: one chat turn of one
    token (llama.cpp is only a peer here, never a dependency)."""
    from models.default_model import default_model_path

    cmd = [binary, "-m", default_model_path(), "-p", prompt, "-n", "1", "-st", "-t", "2",
           "--simple-io", "--no-display-prompt"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-1500:]}")
    return wall, float("nan"), float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", default="Tell me a joke about a cat.")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--variants", default="default;--quantization none",
                    help="';'-separated extra flags per variant ('default': none)")
    ap.add_argument("--llama-cli", help="llama-cli binary: a variant on the same file")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(";")]
    if args.llama_cli:
        variants.append("llama-cli")
    flags = {v: [] if v in ("default", "llama-cli") else v.split() for v in variants}
    rows: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    for r in range(args.rounds + 1):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            result = (run_llama_cli(args.llama_cli, args.prompt) if v == "llama-cli"
                      else run_once(args.prompt, flags[v], args.chat))
            if r > 0:  # round 0 fills the compilation cache
                rows[v].append(result)
                print(f"round {r} {v:24s} wall {result[0]:6.2f} s  load {result[1]:5.2f} s  "
                      f"first token {result[2]:6.0f} ms  load average "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"medians over {args.rounds} rounds ({'chat' if args.chat else 'generate'}, "
          f"prompt {args.prompt!r}):")
    for v in variants:
        wall, load, first = (statistics.median(x[i] for x in rows[v]) for i in range(3))
        print(f"  {v:24s} wall {wall:6.2f} s  load {load:5.2f} s  first token {first:6.0f} ms"
              f"  start/imports/exit {wall - load - first / 1000:5.2f} s")


if __name__ == "__main__":
    main()

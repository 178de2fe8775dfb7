"""Same as `jaxserve bench latency ...` (see BENCHMARKS.md for the commands behind each table).

    python scripts/bench_latency.py --help
"""

from __future__ import annotations

import sys

from jaxserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "latency", *sys.argv[1:]]))

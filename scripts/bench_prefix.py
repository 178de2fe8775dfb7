"""Same as `jaxserve bench prefix ...` (see BENCHMARKS.md for the commands behind each table).

    python scripts/bench_prefix.py --help
"""

from __future__ import annotations

import sys

from jaxserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "prefix", *sys.argv[1:]]))

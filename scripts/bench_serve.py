"""Same as `jaxserve bench serve ...` (see BENCHMARKS.md for the commands behind each table).

    python scripts/bench_serve.py --help
"""

from __future__ import annotations

import sys

from jaxserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))

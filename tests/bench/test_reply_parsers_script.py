"""`scripts/benchmarks/bench_reply_parsers.py`: one table row per tool-call parser and length,
in-process."""

import runpy
import sys

from jaxserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

MODULE = "scripts.benchmarks.bench_reply_parsers"


def test_times_every_parser_beside_the_baseline(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [MODULE, "--words", "20", "40", "--rounds", "1"])
    runpy.run_module(MODULE, run_name="__main__")
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| parser")]
    assert [(r[0].strip(), int(r[1])) for r in rows] == \
        [(p, w) for w in (20, 40) for p in TOOL_PARSERS]
    assert all(float(r[3]) > 0 and r[4].strip().endswith("x") for r in rows)

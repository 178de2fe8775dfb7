"""Writes tests/durations.json (test file -> seconds) from pytest junit XML reports.

`tests/conftest.py` hands the test files to the xdist workers in that file's order, longest
first (files it does not name last, by name), so the long files start first and the workers
finish together. Regenerate it from a default-tier run on a clean clone (an empty
compilation cache: that is what CI pays) when files' costs change much:

    pytest -q --junitxml=run.xml
    python -m tests.record_durations run.xml

Each file's seconds are the sum of its tests' times in the report (pytest's default
`junit_duration_report = total`: setup, call and teardown, so a module fixture's engine
counts in its file). Several reports (e.g. three runs on a shared VM) give each file's mean
over the reports that ran it. `--update` keeps the entries of files the reports do not
name (a partial run); without it the file holds exactly the files the reports ran.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
DURATIONS = ROOT / "tests" / "durations.json"


def file_of(classname: str, root: pathlib.Path = ROOT) -> str | None:
    """The test file a junit `classname` belongs to ("tests.e2e.test_greedy" or
    "tests.e2e.test_x.TestClass" -> "tests/e2e/test_x.py"), the longest dotted prefix that
    is a file under `root`; None when there is none (a file deleted since the run)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (root / path).is_file():
            return path
    return None


def file_seconds(report: str | pathlib.Path, root: pathlib.Path = ROOT) -> dict[str, float]:
    """Each test file's summed test time in one junit XML report."""
    seconds: dict[str, float] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = file_of(case.get("classname", ""), root)
        if path is not None:
            seconds[path] = seconds.get(path, 0.0) + float(case.get("time") or 0.0)
    return seconds


def mean_seconds(reports: list[dict[str, float]]) -> dict[str, float]:
    """Each file's mean over the reports that name it, rounded to 0.1 s."""
    runs: dict[str, list[float]] = {}
    for report in reports:
        for path, secs in report.items():
            runs.setdefault(path, []).append(secs)
    return {path: round(sum(v) / len(v), 1) for path, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.record_durations",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="junit XML files (pytest --junitxml)")
    parser.add_argument("--output", default=str(DURATIONS), help="default: %(default)s")
    parser.add_argument("--update", action="store_true",
                        help="keep the entries of files that the reports do not name")
    args = parser.parse_args(argv)
    for report in args.reports:
        if "</testsuites>" not in pathlib.Path(report).read_text()[-200:]:
            parser.error(f"{report} is not a complete junit report (still being written?)")
    durations = mean_seconds([file_seconds(r) for r in args.reports])
    output = pathlib.Path(args.output)
    if args.update and output.exists():
        durations = {**json.loads(output.read_text()), **durations}
    output.write_text(json.dumps(dict(sorted(durations.items())), indent=1) + "\n")
    print(f"{output}: {len(durations)} files, {sum(durations.values()):.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

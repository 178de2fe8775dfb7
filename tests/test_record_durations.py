"""tests/record_durations.py sums junit test times per file; conftest orders files by them."""

from __future__ import annotations

import json

import pytest

from tests.conftest import file_order
from tests.record_durations import file_of, main

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.e2e.test_greedy" name="test_a" time="1.25" />
<testcase classname="tests.e2e.test_greedy" name="test_b[x]" time="2.5"><skipped /></testcase>
<testcase classname="tests.core.test_scheduler.TestPolicy" name="test_c" time="0.5" />
<testcase classname="tests.core.test_scheduler" name="test_d" time="0.25" />
<testcase classname="tests.e2e.test_deleted_since" name="test_e" time="9.0" />
</testsuite></testsuites>
"""


def test_classnames_map_to_existing_files():
    assert file_of("tests.e2e.test_greedy") == "tests/e2e/test_greedy.py"
    assert file_of("tests.core.test_scheduler.TestPolicy") == "tests/core/test_scheduler.py"
    assert file_of("tests.e2e.test_deleted_since") is None


def test_sums_per_file_means_over_reports_and_updates(tmp_path):
    first, second = tmp_path / "a.xml", tmp_path / "b.xml"
    first.write_text(REPORT)
    second.write_text(REPORT.replace('time="1.25"', 'time="3.25"'))
    out = tmp_path / "durations.json"
    out.write_text(json.dumps({"tests/test_docs.py": 7.0}))
    main([str(first), "--output", str(out)])
    assert json.loads(out.read_text()) == {"tests/core/test_scheduler.py": 0.8,
                                           "tests/e2e/test_greedy.py": 3.8}
    out.write_text(json.dumps({"tests/test_docs.py": 7.0, "tests/e2e/test_greedy.py": 1.0}))
    main([str(first), str(second), "--output", str(out), "--update"])
    assert json.loads(out.read_text()) == {"tests/core/test_scheduler.py": 0.8,
                                           "tests/e2e/test_greedy.py": 4.8,
                                           "tests/test_docs.py": 7.0}


def test_an_unfinished_report_is_refused(tmp_path):
    report = tmp_path / "run.xml"
    report.write_text(REPORT.removesuffix("</testsuite></testsuites>\n"))
    with pytest.raises(SystemExit):
        main([str(report), "--output", str(tmp_path / "durations.json")])
    assert not (tmp_path / "durations.json").exists()


def test_files_run_longest_first_then_unknown_ones_by_name():
    durations = {"tests/b.py": 5.0, "tests/c.py": 50.0, "tests/z.py": 0.0}
    paths = ["tests/a.py", "tests/b.py", "tests/c.py", "tests/y.py", "tests/z.py"]
    assert sorted(paths, key=lambda p: file_order(p, durations)) == [
        "tests/c.py", "tests/b.py", "tests/z.py", "tests/a.py", "tests/y.py"]

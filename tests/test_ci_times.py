"""``tools/ci_times.py``: what ``.ci/run`` prints after each suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).parent.parent / "tools" / "ci_times.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_one" time="3.5"/>
<testcase classname="tests.test_a" name="test_two[x]" time="0.5"/>
<testcase classname="tests.models.test_zoo.TestZoo" name="test_llama" time="6.0"/>
<testcase classname="tests.test_b" name="test_skipped" time="0.0"><skipped/></testcase>
</testsuite></testsuites>
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          check=False)


def test_files_and_tests_by_their_time(tmp_path: Path) -> None:
    junit = tmp_path / "suite.xml"
    junit.write_text(JUNIT)
    proc = _run("torch-2.13.0", "754", str(junit), "--files", "2", "--tests", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == ("== time: torch-2.13.0: 12.6 min wall, 0.2 min of test time in 4 "
                        "tests ==")
    # files by summed time (a class folds into its file), at most --files of them
    assert lines[2].split() == ["6.0", "s", "60.0%", "1", "tests/models/test_zoo.py"]
    assert lines[3].split() == ["4.0", "s", "40.0%", "2", "tests/test_a.py"]
    assert lines[4] == "  slowest tests:"
    assert lines[5].split() == ["6.0", "s", "tests/models/test_zoo.py::test_llama"]
    assert lines[6].split() == ["3.5", "s", "tests/test_a.py::test_one"]
    assert len(lines) == 7


def test_a_missing_report_prints_the_wall_time_and_succeeds(tmp_path: Path) -> None:
    proc = _run("torch-2.11.0", "60", str(tmp_path / "absent.xml"))
    assert proc.returncode == 0  # printing only: a CI run never fails here
    assert proc.stdout.startswith("== time: torch-2.11.0: 1.0 min wall (no per-test times: ")

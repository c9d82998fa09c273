"""Where a test suite's time went, from pytest's JUnit XML (``--junitxml``).

``.ci/run`` prints this after each suite, so that a change which adds minutes shows in its
own CI output: the suite's wall time, the files by their summed test time, and the slowest
tests. It prints and never fails: a noisy machine must not turn a correct change red.

    python tools/ci_times.py SUITE_NAME WALL_SECONDS junit.xml [--files 12] [--tests 8]

NB: with pytest-xdist the summed test time is the work of every worker; the wall time is
about that sum over the number of workers.
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def test_times(path: Path) -> list[tuple[str, str, float]]:
    """(file, test name, seconds) of every test case in a JUnit XML file."""
    cases = []
    for case in ET.parse(path).iter("testcase"):
        # classname is the dotted path of the file, then the class if any: tests.test_x.TestY
        parts = [p for p in case.get("classname", "").split(".") if p]
        module = [p for p in parts if not p[:1].isupper()]
        name = "/".join(module) + ".py" if module else "?"
        cases.append((name, case.get("name", "?"), float(case.get("time") or 0.0)))
    return cases


def report(suite: str, wall: float, cases: list[tuple[str, str, float]], files: int = 12,
           tests: int = 8) -> str:
    per_file: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for name, _, seconds in cases:
        per_file[name] += seconds
        count[name] += 1
    total = sum(per_file.values())
    lines = [f"== time: {suite}: {wall / 60:.1f} min wall, {total / 60:.1f} min of test time "
             f"in {len(cases)} tests =="]
    lines.append(f"  slowest files (summed test time, share, tests):")
    for name, seconds in per_file.most_common(files):
        share = seconds / total if total else 0.0
        lines.append(f"  {seconds:8.1f} s  {share:5.1%}  {count[name]:5d}  {name}")
    lines.append(f"  slowest tests:")
    for name, test, seconds in sorted(cases, key=lambda c: -c[2])[:tests]:
        lines.append(f"  {seconds:8.1f} s  {name}::{test}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite")
    parser.add_argument("wall", type=float, help="the suite's wall time in seconds")
    parser.add_argument("junit", type=Path)
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--tests", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        cases = test_times(args.junit)
    except (OSError, ET.ParseError) as exc:  # printing only: never fail the run
        print(f"== time: {args.suite}: {args.wall / 60:.1f} min wall (no per-test times: "
              f"{exc}) ==")
        return 0
    print(report(args.suite, args.wall, cases, args.files, args.tests))
    return 0


if __name__ == "__main__":
    sys.exit(main())

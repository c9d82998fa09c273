"""Read a pytest JUnit XML report and fail when a GPU run did not really run the GPU tests.

    python tools/check_junit.py report.xml [--cuda]

Exit status 1, with the reason, when:
- no test ran at all (a collection error or a missing module can empty a run);
- a test errored or failed;
- with ``--cuda``: any test was skipped for want of CUDA or of a module that a GPU run must
  have (``expecttest``, which torch's own autocast test lists import), since on a machine with
  a GPU such a skip means a CUDA test silently did not run.

Prints one line of counts and the skip reasons grouped, so a summary shows what did not run.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET
from typing import Sequence

# Skip reasons that mean "this needs a GPU (or a module a GPU run carries) and did not get one".
MUST_RUN_ON_GPU = re.compile(r"needs (a )?CUDA|CUDA device|no GPU|could not import 'expecttest'",
                             re.IGNORECASE)


def read(path: str) -> tuple[collections.Counter[str], collections.Counter[str], list[str]]:
    """(counts by outcome, skip reasons with their counts, ids of failed or errored tests)."""
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    broken: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                broken.append(name)
            elif child.tag == "skipped":
                message = child.get("message") or ""
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                if outcome == "skipped":
                    reasons[message.strip()[:160]] += 1
        counts[outcome] += 1
    return counts, reasons, broken


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--cuda", action="store_true",
                        help="fail on skips that mean a CUDA test did not run")
    args = parser.parse_args(argv)
    counts, reasons, broken = read(args.report)
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test cases")
    for reason, n in reasons.most_common():
        print(f"  skipped {n:4d}x: {reason}")
    problems = []
    if counts["passed"] == 0:
        problems.append("no test passed: the run collected nothing or failed to import")
    if broken:
        problems.append(f"{len(broken)} failed or errored: " + ", ".join(broken[:20]))
    if args.cuda:
        missed = {r: n for r, n in reasons.items() if MUST_RUN_ON_GPU.search(r)}
        if missed:
            problems.append(f"{sum(missed.values())} tests skipped on a GPU machine for want of "
                            f"CUDA or expecttest: {sorted(missed)}")
    for problem in problems:
        print("FAIL:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

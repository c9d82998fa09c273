"""tools/gpu_check.sh: its syntax, and a CPU dry run of two of its steps (the GPU run itself
needs a GPU)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def test_gpu_check_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_gpu_check_dry_run_writes_a_summary(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--steps", "expecttest,pytest"],
                         env=env, capture_output=True, text=True, timeout=120)
    summary = (tmp_path / "summary.md").read_text()
    assert run.returncode == 0, summary + run.stderr
    assert "| expecttest | ok |" in summary and "| pytest | ok |" in summary
    assert "| zoo_fp16 | skipped (not in --steps) |" in summary
    assert "every step passed" in summary

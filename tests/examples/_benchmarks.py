"""The benchmark run as a user runs it: ``python -m benchmarks ...`` from the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmarks(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks *args`` in the repository (warnings quiet), asserted to succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=580,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done

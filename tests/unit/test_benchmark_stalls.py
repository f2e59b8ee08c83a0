"""A benchmark fit that does not return says where it waits: every thread's stack on stderr."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import workloads


def test_a_stalled_fit_prints_where_it_waits_and_a_quick_one_prints_nothing(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with workloads._stacks_if_stalled(0.2):
        time.sleep(0.5)
    stalled = capfd.readouterr().err
    assert "Timeout" in stalled and "test_benchmark_stalls.py" in stalled, stalled
    with workloads._stacks_if_stalled(5.0):
        pass
    with workloads._stacks_if_stalled(0.0):  # never
        time.sleep(0.3)
    time.sleep(0.3)
    assert capfd.readouterr().err == ""

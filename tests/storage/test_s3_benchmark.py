"""The object-storage benchmark's quick mode runs against its own S3 server and writes its
table (the figures themselves are in docs/performance.md, never asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

ROOT = Path(__file__).resolve().parents[2]


def test_the_s3_benchmark_quick_mode_writes_its_table(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    command = [sys.executable, "-m", "benchmarks", "--only-s3", "--quick"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path), "--dir", str(tmp_path / "scratch")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env, "PYTHONWARNINGS": "ignore"},
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (table,) = tmp_path.glob("*-s3-quick.md")
    text = table.read_text()
    for row in ("publish to S3", "read through a view", "write to local disk"):
        assert row in text, text

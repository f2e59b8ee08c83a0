"""The benchmark's quick mode runs end to end, so the benchmark code cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_benchmark_quick_mode_writes_results_table_and_chart(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            "--out",
            str(tmp_path),
            "--dir",
            str(tmp_path / "scratch"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = tmp_path.glob("*-quick.json")
    data = json.loads(result.read_text())
    (run,) = data["runs"]
    assert run["limit"]["write_gbps"] > 0 and run["limit"]["read_gbps"] > 0
    methods = {k for k, v in run["methods"].items() if isinstance(v, dict)}
    assert methods == {
        "ours-sync",
        "ours-async",
        "raw dist_checkpointing",
        "torch.save (Lightning default)",
        "torch.distributed.checkpoint",
        "ours-async (megatron writer)",
        "torch DCP async",
    }
    # Every target of the issue is judged, first saves included.
    assert run["methods"]["ours-sync"]["first_save_s"] > 0
    assert run["methods"]["ours-async"]["first_blocking_s"] > 0
    for figures in run["methods"].values():
        if isinstance(figures, dict):
            assert figures["save_s"]["median"] > 0 and figures["bytes"] > 0
    assert run["step_overhead"]["callback_s"] > 0 and data["hf_export"][0]["seconds"] > 0
    table = result.with_suffix(".md").read_text()
    assert "| ours-sync |" in table and "### Targets" in table
    for target in (
        "disk write",
        "async blocking",
        "first async",
        "first sync",
        "async total",
        "cold load >= 0.8",
        "torch.load",
        "step overhead",
    ):
        assert target in table, target
    assert result.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "scratch").exists()  # scratch space is cleaned up

"""The object-storage benchmark's quick mode runs against its own S3 server and writes its
table (the figures themselves are in docs/performance.md, never asserted); so does its nodes
mode (``--nodes 1,2``: one step uploaded by one process, then by two simulated nodes)."""

from __future__ import annotations

import json
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


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


# A simulated-node cell beyond CI's tier: the node-local upload it runs is proven in CI by
# tests/nodes/test_store_without_shared_fs.py; this checks the benchmark's own mode.
@pytest.mark.nodes_extended
def test_the_s3_benchmark_nodes_mode_uploads_each_nodes_share_and_writes_its_rows(
    tmp_path: Path,
) -> None:
    from lightning_mcore_ckpt.testing import nodes_unavailable

    why = nodes_unavailable()
    if why is not None:  # CI runs as root: a skip there would hide a broken runner
        if _under_ci():
            pytest.fail(f"simulated nodes cannot run under CI: {why}")
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    command = [sys.executable, "-m", "benchmarks", "--only-s3", "--quick", "--nodes", "1,2"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path), "--dir", str(tmp_path / "scratch")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**env, "PYTHONWARNINGS": "ignore"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (table,) = tmp_path.glob("*-s3-nodes-quick.md")
    lines = table.read_text().splitlines()
    assert [line.split(" | ")[0] for line in lines if line[:4] in ("| 1 ", "| 2 ")] == [
        "| 1",
        "| 2",
    ]
    assert "x the rate" in next(line for line in lines if line.startswith("| 2 "))
    (raw,) = tmp_path.glob("*-s3-nodes-quick.json")
    result = json.loads(raw.read_text())
    (one,), (two,) = result["rows"]["1"], result["rows"]["2"]
    # One process uploaded the whole step; at 2 nodes, each node uploaded its own half and
    # rank 0 published the step from both parts.
    assert one["upload_nodes"] == 1 and one["node_bytes"][0] >= result["bytes"]
    assert two["upload_nodes"] == 2
    assert two["node_bytes"] == [result["bytes"] // 2] * 2
    for row in (one, two):
        assert row["bytes"] >= result["bytes"] and row["seconds"] > 0
        assert row["server_cpu_s"] >= 0 and row["client_cpu_s"] > 0
    # Nothing is left behind: the scratch directory, the nodes' directories included.
    assert not (tmp_path / "scratch" / "s3-nodes").exists()

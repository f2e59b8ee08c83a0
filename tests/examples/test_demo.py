"""The README's demo command trains with TP=2 on 2 processes and writes a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_demo_trains_tp2_and_prints_where_the_checkpoint_is(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    step_dir = out / "global_step_2"
    assert f"checkpoint: {step_dir}" in result.stdout
    assert "trained 2 steps with TP=2 on 2 processes" in result.stdout
    assert (step_dir / "model" / ".metadata").is_file()
    assert (step_dir / "optim" / ".metadata").is_file()
    assert sorted(p.name for p in (step_dir / "extra").iterdir()) == [
        "rank_00000.pt",
        "rank_00001.pt",
    ]

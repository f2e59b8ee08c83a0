"""The README's demo: train, preempt, resume exactly, export once, ls and report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_demo_tells_the_whole_story_and_checks_it(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stdout = result.stdout
    assert "preempted after step 2 (SIGTERM), saved, exited cleanly" in stdout
    assert "resumed at step 2, trained to step 4" in stdout
    assert "resumed run matches the uninterrupted one bit for bit: True" in stdout
    # One Hugging Face copy, in the final step only (the preempted save exported nothing).
    run = out / "run"
    assert sorted(p.parent.name for p in run.glob("global_step_*/huggingface")) == ["global_step_4"]
    assert "global_step_4     " in stdout and "huggingface  (last)" in stdout  # ls
    assert '* "last": what trainer.fit(ckpt_path="last") resumes from' in stdout  # report
    assert (out / "saves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"Hugging Face copy: {run / 'global_step_4' / 'huggingface'}" in stdout
    assert "transformers generates: 'a b c" in stdout

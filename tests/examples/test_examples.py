"""The examples run end to end in a quick mode and check their own outcome."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=280, cwd=cwd, env=ENV
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.timeout(300)
def test_lightning_cli_config_trains_and_the_same_command_resumes(tmp_path: Path) -> None:
    script, config = (
        str(ROOT / "examples" / "pretrain_gpt.py"),
        str(ROOT / "examples" / "config.yaml"),
    )
    _run(tmp_path, script, "fit", "--config", config, "--trainer.max_steps", "4")
    ckpt = tmp_path / "checkpoints" / "pretrain"
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_2", "global_step_4"]
    _run(tmp_path, script, "fit", "--config", config, "--trainer.max_steps", "6")
    # Strategy, callback and logger all came from the YAML; "last" resumed at step 4, so the
    # second run trained (and logged) two steps, not six.
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_4", "global_step_6"]
    first, second = sorted((tmp_path / "logs").glob("lightning_logs/version_*/metrics.csv"))
    for log, steps in ((first, 4), (second, 2)):
        with open(log) as f:
            assert sum(1 for row in csv.DictReader(f) if row.get("train_loss")) == steps


@pytest.mark.timeout(300)
def test_finetune_from_hf_imports_trains_exports_and_generates(tmp_path: Path) -> None:
    out = tmp_path / "ft"
    done = _run(
        tmp_path, str(ROOT / "examples" / "finetune_from_hf.py"), "--steps", "2", "--out", str(out)
    )
    exported = out / "checkpoints" / "global_step_2" / "huggingface"
    assert "fine-tuned 2 steps from" in done.stdout
    assert f"Hugging Face copy: {exported}" in done.stdout
    assert "transformers generates: 'a b c" in done.stdout
    assert (out / "imported" / "model" / ".metadata").is_file()
    assert sorted(p.parent.name for p in out.glob("checkpoints/global_step_*/huggingface")) == [
        "global_step_2"
    ]

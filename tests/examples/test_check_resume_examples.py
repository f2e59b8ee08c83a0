"""check-resume on every example reports exact: the config example through the command line,
the demo's and the fine-tuning example's jobs through the Python API."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mcore_ckpt import check_resume

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}

pytestmark = [pytest.mark.matrix, pytest.mark.timeout(600)]


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_mcore_ckpt.cli.entry", "check-resume", *args],
        capture_output=True,
        text=True,
        timeout=580,
        cwd=cwd,
        env=ENV,
    )


def test_the_config_example_resumes_exactly_every_way(tmp_path: Path) -> None:
    done = _cli(
        tmp_path,
        "--config",
        str(ROOT / "examples" / "config.yaml"),
        "--stop-at",
        "3",
        "--max-steps",
        "6",
        "--json",
        "--workdir",
        str(tmp_path / "work"),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    # Every rank's Lightning banners and the libraries' known notices are in the runs' log,
    # which the command names last; its own notices are shown (SIGTERM, the killed run's lock).
    log = tmp_path / "work" / "check-resume.log"
    assert done.stderr.rstrip().endswith(f"notices: {log}"), done.stderr
    assert "SIGTERM received: saving step 3 synchronously and stopping" in done.stderr
    banners = ("GPU available: False", "Initializing distributed: GLOBAL_RANK: 1", "Seed set to 0")
    assert [b for b in banners if b in done.stderr] == [], done.stderr
    assert [b for b in banners if b not in log.read_text()] == []
    assert report["exact"] and report["deterministic"] and report["world_size"] == 2
    assert [(r["how"], r["exact"]) for r in report["results"]] == [
        ("clean", True),
        ("sigterm", True),
        ("kill", True),
    ]
    # The config's own checkpoint directory is never touched: every run has its own.
    assert not (tmp_path / "checkpoints").exists()


def test_bad_usage_exits_2_with_the_reason(tmp_path: Path) -> None:
    config = str(ROOT / "examples" / "config.yaml")
    done = _cli(tmp_path, "--config", config, "--stop-at", "8")
    assert done.returncode == 2 and "stop_at must be before max_steps" in done.stderr
    # The same checks in this process (the command above proved the installed entry point).
    from _cli import run_cli

    done = run_cli("check-resume", "--config", str(tmp_path / "missing.yaml"), "--stop-at", "2")
    assert done.returncode == 2 and "no such file" in done.stderr
    old_style = tmp_path / "old.yaml"
    old_style.write_text("trainer: {devices: 1, max_steps: 4}\nmodel: {lr: 0.1}\n")
    done = run_cli("check-resume", "--config", str(old_style), "--stop-at", "2")
    assert done.returncode == 2 and "class_path" in done.stderr


@pytest.mark.parametrize("example", ["demo", "finetune_from_hf"])
def test_the_python_examples_resume_exactly(tmp_path: Path, example: str) -> None:
    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    sys.path.insert(0, str(ROOT / "examples"))
    module = __import__(example)
    if example == "demo":
        tiny_hf_model(tmp_path / "hf_source", "qwen2", vocab_size=128)
        build = functools.partial(module.job, tmp_path)
    else:
        source = tiny_hf_model(tmp_path / "hf_source", "qwen2")
        hf.import_checkpoint(source, tmp_path / "imported", prefix="model.")
        build = functools.partial(module.job, source, tmp_path / "imported", tmp_path)
    report = check_resume(build, stop_at=3, max_steps=5, world_size=2)
    assert report.exact, str(report)
    assert [r.how for r in report.results] == ["clean", "sigterm", "kill"]

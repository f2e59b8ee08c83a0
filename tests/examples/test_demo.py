"""The README's demo: train, preempt, resume exactly, export once, ls and report; what the
libraries and Lightning say about themselves goes to its log, not the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
ENV.pop("PYTHONWARNINGS", None)  # as a user runs it: nothing hidden but what the demo hides

NOISE = [
    # Lightning's, at every save where the callback left weights_only unset (ours, fixed).
    "`weights_only` was not set",
    # The known notices of the libraries underneath, which the demo and the command line hide.
    "GPTModel IS DEPRECATED",
    "'set_vital' is deprecated",
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "we are deprecating ShardedTensor",
    "absl.logging is not installed",
    "torch.distributed is disabled, unavailable or uninitialized",
    "The argument order of load has been changed",
]
BANNERS = [
    # Lightning's, in each process, and the progress bars of transformers: in the demo's log.
    "GPU available: False, used: False",
    "TPU available: False",
    "Initializing distributed: GLOBAL_RANK: 1",
    "distributed_backend=gloo",
    "You defined a `validation_step` but have no `val_dataloader`",
    "Writing model shards",
    "Loading weights",
]


@pytest.mark.timeout(900)
def test_demo_tells_the_whole_story_and_checks_it(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "4", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The story's stderr: our own notices, none of the known noise nor Lightning's banners,
    # which are in the log the demo names (from both of its processes).
    assert "SIGTERM received: saving step 2 synchronously and stopping" in result.stderr
    assert [n for n in NOISE + BANNERS if n in result.stderr] == [], result.stderr
    log = (out / "run.log").read_text()
    assert [n for n in NOISE[1:] + BANNERS[:5] if n not in log] == [], log
    stdout = result.stdout
    assert f"Lightning's messages and the libraries' own notices: {out / 'run.log'}" in stdout
    assert "preempted after step 2 (SIGTERM), saved, exited cleanly" in stdout
    assert "resumed at step 2, trained to step 4" in stdout
    assert "resumed run matches the uninterrupted one bit for bit: True" in stdout
    # One Hugging Face copy, in the final step only (the preempted save exported nothing).
    run = out / "run"
    assert sorted(p.parent.name for p in run.glob("global_step_*/huggingface")) == ["global_step_4"]
    assert "global_step_4     " in stdout and "huggingface  (last)" in stdout  # ls
    assert "the run saved steps 2, 4: all kept" in stdout  # max_to_keep=2: nothing removed
    assert '* "last": what trainer.fit(ckpt_path="last") resumes from' in stdout  # report
    assert (out / "saves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"Hugging Face copy: {run / 'global_step_4' / 'huggingface'}" in stdout
    assert "transformers generates: 'a b c" in stdout

    # The command line on the run's steps, as installed: no known noise either.
    exe = Path(sys.executable).with_name("lightning-mcore-ckpt")
    for args in (
        ["inspect", run / "global_step_4"],
        ["diff", run / "global_step_2", run / "global_step_4"],
    ):
        done = subprocess.run(
            [str(exe), *map(str, args)], capture_output=True, text=True, timeout=240, env=ENV
        )
        assert done.returncode in (0, 1), done.stderr[-3000:]
        assert [n for n in NOISE if n in done.stderr] == [], (args[0], done.stderr)


@pytest.mark.timeout(200)
def test_a_real_error_of_the_demo_is_still_shown(tmp_path: Path) -> None:
    out = tmp_path / "a_file"
    out.write_text("not a directory")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=ENV,
    )
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert f"FileExistsError: [Errno 17] File exists: '{out}'" in result.stderr, result.stderr


def test_the_demo_says_which_steps_retention_removed_and_why(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from demo import retention_story

    from lightning_mcore_ckpt.format import layout, markers

    run = tmp_path / "run"
    for step in (6, 8):  # on disk: what retention left of steps 2, 4, 6 and 8
        path = layout.step_dir(run, step)
        path.mkdir(parents=True)
        (path / markers.METADATA_FILE).write_text(f'{{"global_step": {step}}}')
    assert retention_story(run, [2, 4, 6, 8], keep=2, preempted=4) == [
        "the run saved steps 2, 4, 6, 8; retention removed:",
        "  global_step_2: max_to_keep=2, and newer steps 6, 8 completed",
        "  global_step_4 (the preemption save): max_to_keep=2, and newer steps 6, 8 completed",
    ]
    assert retention_story(run, [6, 8], keep=2, preempted=7) == [
        "the run saved steps 6, 8: all kept"
    ]

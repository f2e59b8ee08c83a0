"""Promise 2: a preempted job saves the step it is on, ends cleanly, says so, and resumes exactly;
under SLURM with Lightning's auto-requeue, the job is requeued once, after that step committed.

Real processes get real signals (``signal_at`` in _faulty.py) and, for SLURM, srun's variables,
so that Lightning itself detects SLURM and installs its requeue handler. ``scontrol`` is a fake,
first on PATH, that records how it was called and what the checkpoint directory held then.

A signal also lands in the middle of a save: the rank's shard writer (a thread of ours, or
Megatron-Core's writer, a forked process when asynchronous) sends it while it writes the model's
shards and is held there until the rank caught it (a sync save, a few seconds at most) or until
every rank agreed to stop (an async write still in flight when the preemption save begins).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from _faulty import FAULT_STEP, events, listing, same_run, train

from lightning_mcore_ckpt import MegatronCheckpoint
from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.storage.lock import LOCK_FILE
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

TP2 = {"tp": 2}
TRACKER = layout.TRACKER_FILE
JOB = "4242"
PREEMPTED_AT = 3  # not a save step (every 2)

_SCONTROL = """#!{python}
import json, os, sys
from pathlib import Path

root = Path(os.environ["FAKE_SCONTROL_CKPT"])
tracker = root / {tracker!r}
step = int(tracker.read_text()) if tracker.exists() else None
with open(os.environ["FAKE_SCONTROL_LOG"], "a") as log:
    log.write(json.dumps({{
        "argv": sys.argv[1:],
        "tracker": step,
        "committed": step is not None
        and (root / f"global_step_{{step}}" / {metadata!r}).exists(),
        "locked": (root / {lock!r}).exists(),
    }}) + "\\n")
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted run on 2 ranks (TP=2) with the same saves, outside SLURM."""
    tmp = tmp_path_factory.mktemp("reference")
    return run_distributed(train, 2, str(tmp), None, TP2, timeout=250)[0]


def _scontrol(tmp: Path) -> tuple[dict[str, str], Path]:
    """A fake ``scontrol`` first on PATH: the ranks' environment, and the file it logs to."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(
        _SCONTROL.format(
            python=sys.executable,
            tracker=TRACKER,
            metadata=markers.METADATA_FILE,
            lock=LOCK_FILE,
        )
    )
    script.chmod(0o755)
    log = tmp / "scontrol.jsonl"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SCONTROL_LOG": str(log),
        "FAKE_SCONTROL_CKPT": str(tmp / "run" / "ckpt"),
    }
    return env, log


def _calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _assert_preempted(
    results: list[dict[str, Any]], signum: int, environment: str, at: int = PREEMPTED_AT
) -> None:
    for r in results:
        assert r["environment"] == environment  # Lightning saw (or did not see) SLURM
        assert r["end"] == at  # every rank stopped after the same step, no error
        assert r["preempted"] is True
        assert r["preemption_signal"] == signal.Signals(signum).name
        assert r["exit_code"] == MegatronCheckpoint.PREEMPTED_EXIT_CODE == 143


def _assert_not_preempted(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert (r["preempted"], r["preemption_signal"], r["exit_code"]) == (False, None, 0)


def _assert_saved_without_hpc(run: Path) -> None:
    meta = markers.read_metadata(run / "ckpt" / f"global_step_{PREEMPTED_AT}")
    assert meta is not None and meta["async"] is False  # written before exiting
    assert listing(run) == ["global_step_2", f"global_step_{PREEMPTED_AT}", TRACKER]  # no lock
    assert not list(run.glob("hpc_ckpt_*"))  # Lightning's own SLURM save was not made


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_preemption_saves_synchronously_and_exits_cleanly(
    tmp_path: Path, signum: int, reference: dict[str, Any]
) -> None:
    _assert_not_preempted([reference])
    env, log = _scontrol(tmp_path)
    run = tmp_path / "run"
    # Only rank 1 gets the signal, after step 3 (not a save step), with async saves configured.
    options = {**TP2, "async_save": True, "max_to_keep": None}
    signal_at = (PREEMPTED_AT, signum, 1)
    stopped = run_distributed(
        train, 2, str(run), None, {**options, "signal_at": signal_at}, timeout=250, env=env
    )
    _assert_preempted(stopped, signum, "LightningEnvironment")
    _assert_saved_without_hpc(run)
    assert _calls(log) == []  # not under SLURM: nothing is requeued
    resumed = run_distributed(train, 2, str(run), None, options, timeout=250, env=env)
    same_run(resumed[0], reference, PREEMPTED_AT)
    _assert_not_preempted(resumed)


def test_slurm_requeue_signal_requeues_the_job_once_its_step_is_committed(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    env, log = _scontrol(tmp_path)
    run = tmp_path / "run"
    slurm = {**TP2, "async_save": True, "max_to_keep": None, "slurm_job": JOB}
    # SIGUSR1 is Lightning's default requeue signal; only rank 1 gets it (rank 0 requeues).
    signal_at = (PREEMPTED_AT, signal.SIGUSR1, 1)
    stopped = run_distributed(
        train, 2, str(run), None, {**slurm, "signal_at": signal_at}, timeout=250, env=env
    )
    _assert_preempted(stopped, signal.SIGUSR1, "SLURMEnvironment")
    _assert_saved_without_hpc(run)
    # One call, by one rank, after the step was committed and the directory's lock released.
    assert _calls(log) == [
        {"argv": ["requeue", JOB], "tracker": PREEMPTED_AT, "committed": True, "locked": False}
    ]
    # The requeued job: same command, same job id, no signal.
    resumed = run_distributed(train, 2, str(run), None, slurm, timeout=250, env=env)
    same_run(resumed[0], reference, PREEMPTED_AT)
    _assert_not_preempted(resumed)
    assert len(_calls(log)) == 1


@pytest.mark.parametrize(
    ("signum", "auto_requeue"),
    [(signal.SIGTERM, None), (signal.SIGUSR1, False)],
    ids=["SIGTERM-auto_requeue", "SIGUSR1-no_auto_requeue"],
)
def test_slurm_preemption_without_requeue_signal_or_auto_requeue_only_saves(
    tmp_path: Path, signum: int, auto_requeue: bool | None
) -> None:
    env, log = _scontrol(tmp_path)
    run = tmp_path / "run"
    options = {
        **TP2,
        "max_to_keep": None,
        "slurm_job": JOB,
        "auto_requeue": auto_requeue,  # None: detected, and on (Lightning's default)
        "signal_at": (PREEMPTED_AT, signum, 0),
    }
    stopped = run_distributed(train, 2, str(run), None, options, timeout=250, env=env)
    _assert_preempted(stopped, signum, "SLURMEnvironment")
    _assert_saved_without_hpc(run)
    assert _calls(log) == []


# (async save, writer, the rank that gets the signal): every pair of the three axes once.
DURING_A_SAVE = [
    (False, "threads", 1),
    (True, "threads", 0),
    (False, "megatron", 0),
    (True, "megatron", 1),
]


@pytest.mark.parametrize(
    ("async_save", "writer", "rank"),
    DURING_A_SAVE,
    ids=[f"{'async' if a else 'sync'}-{w}-rank{r}" for a, w, r in DURING_A_SAVE],
)
def test_a_signal_during_a_save_stops_cleanly_after_the_next_step(
    tmp_path: Path, async_save: bool, writer: str, rank: int, reference: dict[str, Any]
) -> None:
    run = tmp_path / "run"
    options = {**TP2, "async_save": async_save, "writer": writer, "max_to_keep": None}
    # SIGTERM reaches one rank while its writer writes step 4's model shards; the writer is
    # held until the rank caught it (sync), or until every rank agreed to stop (async: the
    # preemption save begins with step 4's write still in flight).
    until = "agreed" if async_save else "caught"
    fault = f"model_shards:SIGTERM>{until}@{rank}"
    stopped = run_distributed(train, 2, str(run), fault, options, timeout=250)
    happened = [e["event"] for e in events(run)]
    if async_save:
        assert happened == ["sent", "caught", "agreed", "released"], happened
    else:
        # Caught during the save; or, when the kernel handed the signal to the writer thread
        # while the main thread waited for it, once the main thread's wait ended (the writer
        # went on after a few seconds): either way before the next step ended.
        assert happened in (
            ["sent", "caught", "released", "agreed"],
            ["sent", "not released", "caught", "agreed"],
        ), happened
    # Every rank finished step 5 (the step after the signal), saved it and ended cleanly.
    _assert_preempted(stopped, signal.SIGTERM, "LightningEnvironment", at=FAULT_STEP + 1)
    assert listing(run) == ["global_step_2", f"global_step_{FAULT_STEP}", "global_step_5", TRACKER]
    for step in (2, FAULT_STEP, 5):
        assert layout.verify_step(layout.step_dir(run / "ckpt", step)) == []
    interrupted = markers.read_metadata(layout.step_dir(run / "ckpt", FAULT_STEP))
    assert interrupted is not None and interrupted["async"] is async_save
    preempted = markers.read_metadata(layout.step_dir(run / "ckpt", 5))
    assert preempted is not None and preempted["async"] is False
    assert layout.read_tracker(run / "ckpt") == 5
    resumed = run_distributed(train, 2, str(run), None, options, timeout=250)
    same_run(resumed[0], reference, 5)
    same_run(resumed[1], reference, 5)
    _assert_not_preempted(resumed)

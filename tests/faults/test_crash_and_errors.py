"""Promises 1 and 3: a killed rank or a failing disk never costs a committed step (promise 2,
preemption, is test_preemption.py).

Every case runs real Trainers in real processes on real files, injects the fault where it
happens (see _faulty.py), then checks which files exist and which step the next
``fit(ckpt_path="last")`` resumes from, and that it continues bit for bit like a run that was
never interrupted.
"""

from __future__ import annotations

import csv
import errno
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from _faulty import FAULT_STEP, MAX_STEPS, listing, same_run, train

from lightning_mcore_ckpt import layout
from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(300)

LOCK = layout.LOCK_FILE
TP2 = {"tp": 2}
TRACKER = layout.TRACKER_FILE


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted run (1 rank) with the same saves."""
    tmp = tmp_path_factory.mktemp("reference")
    return run_distributed(train, 1, str(tmp), None, timeout=200)[0]


# Kill point -> what is on disk after the crash -> the step "last" resumes from.
KILLS = {
    # While the model's shards are written: step 4 is a partial directory.
    "model_shards": (["global_step_2", f"global_step_{FAULT_STEP}?"], 2),
    # While the optimizer's shards are written (the model's are on disk).
    "optim_shards": (["global_step_2", f"global_step_{FAULT_STEP}?"], 2),
    # Every shard and extra/ written, before the commit marker.
    "before_commit": (["global_step_2", f"global_step_{FAULT_STEP}?"], 2),
    # Marker written, tracker not yet updated: step 4 is complete, the tracker says 2.
    "before_tracker": (["global_step_2", f"global_step_{FAULT_STEP}"], 4),
    # Step 4 committed; killed halfway through deleting step 2 (its marker went first).
    "retention": (["global_step_2?", f"global_step_{FAULT_STEP}"], 4),
}


@pytest.mark.parametrize("point", list(KILLS))
def test_sigkill_during_a_save_loses_nothing_committed(
    tmp_path: Path, point: str, reference: dict[str, Any]
) -> None:
    on_disk, resume_at = KILLS[point]
    with pytest.raises(DistributedFailure, match="exit code -9"):
        run_distributed(train, 1, str(tmp_path), f"{point}:kill", timeout=200)
    steps = [name for name in listing(tmp_path) if name.startswith("global_step_")]
    assert steps == on_disk
    assert LOCK in listing(tmp_path)  # left by the killed run; recovered below
    resumed = run_distributed(train, 1, str(tmp_path), None, timeout=200)[0]
    same_run(resumed, reference, resume_at)
    # max_to_keep=1: only the final step remains; crashed leftovers were cleaned up.
    assert listing(tmp_path) == [f"global_step_{MAX_STEPS}", TRACKER]


def test_sigkill_while_the_async_writer_writes_loses_nothing(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    with pytest.raises(DistributedFailure, match="exit code -9"):
        run_distributed(
            train, 1, str(tmp_path), "model_shards:kill", {"async_save": True}, timeout=200
        )
    assert [n for n in listing(tmp_path) if n.startswith("global_step_")] == [
        "global_step_2",
        f"global_step_{FAULT_STEP}?",
    ]
    resumed = run_distributed(train, 1, str(tmp_path), None, {"async_save": True}, timeout=200)[0]
    same_run(resumed, reference, 2)


def test_sigkill_of_one_rank_of_two_loses_nothing(tmp_path: Path) -> None:
    full = run_distributed(train, 2, str(tmp_path / "full"), None, TP2, timeout=250)[0]
    run = str(tmp_path / "run")
    # The killed rank takes the job down (it dies, or its peer's collective fails): the job
    # fails, it does not hang; whichever message the transport gives is not ours to assert.
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(train, 2, run, "optim_shards:kill@1", TP2, timeout=250)
    assert "did not finish within" not in str(failure.value)
    assert [n for n in listing(run) if n.startswith("global_step_")] == [
        "global_step_2",
        f"global_step_{FAULT_STEP}?",
    ]
    resumed = run_distributed(train, 2, run, None, TP2, timeout=250)[0]
    same_run(resumed, full, 2)


def _failed_metric(path: str) -> list[tuple[int, float]]:
    with open(path) as f:
        return [
            (int(r["step"]), float(r["checkpoint/failed"]))
            for r in csv.DictReader(f)
            if r.get("checkpoint/failed")
        ]


def test_write_error_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(train, 2, str(tmp_path), "model_shards:ENOSPC@1", TP2, timeout=250)
    message = str(failure.value)
    assert "CheckpointSaveError" in message and f"global_step_{FAULT_STEP}" in message
    # The original OSError (errno and message) and the shard file it was writing, on every
    # megatron-core version (0.19's writer threads drop the cause unless we keep it).
    assert re.search(
        rf"\[Errno {errno.ENOSPC}\] No space left on device.*: '[^']*global_step_{FAULT_STEP}"
        r"/model/[^']*\.distcp'",
        message,
    ), message
    # The failed step never became complete; the tracker and the older step are untouched.
    # (The launcher kills the other rank once one fails: its lock, or the claim it took to
    # remove it, may be left; the next run recovers either.)
    assert [n for n in listing(tmp_path) if not n.startswith(LOCK)] == [
        "global_step_2",
        f"global_step_{FAULT_STEP}?",
        TRACKER,
    ]
    assert layout.read_tracker(tmp_path / "ckpt") == 2


@pytest.mark.parametrize(
    ("fault", "cause"),
    [("extra:EIO@1", "Input/output error"), ("extra:unpicklable@1", "cannot pickle a generator")],
    ids=["EIO", "not-an-OSError"],
)
def test_extra_state_error_on_one_rank_fails_the_save_everywhere(
    tmp_path: Path, fault: str, cause: str
) -> None:
    results = run_distributed(_catching, 2, str(tmp_path), fault, timeout=250)
    for message in results:
        assert "while writing extra/ (rank 1)" in message and cause in message
    assert layout.read_tracker(tmp_path / "ckpt") == 2
    assert not layout.is_complete(layout.step_dir(tmp_path / "ckpt", FAULT_STEP))


def _catching(rank: int, world_size: int, tmp: str, fault: str) -> str:
    from lightning_mcore_ckpt import CheckpointSaveError

    try:
        train(rank, world_size, tmp, fault, TP2)
    except CheckpointSaveError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "fault", ["model_shards:EIO", "before_commit:EACCES"], ids=["async-write-EIO", "commit-EACCES"]
)
def test_on_save_error_warn_counts_the_failure_and_keeps_training(
    tmp_path: Path, fault: str
) -> None:
    run = run_distributed(
        train,
        1,
        str(tmp_path),
        fault,
        {"async_save": True, "max_to_keep": 1, "on_save_error": "warn"},
        timeout=200,
    )[0]
    assert run["end"] == MAX_STEPS and run["failed_saves"] == 1
    assert _failed_metric(run["csv"]) == [(FAULT_STEP, 1.0)]
    # The failed step never committed and did not count for retention: step 2 was kept until
    # step 6 committed; the failed directory was cleaned up then.
    assert listing(tmp_path) == [f"global_step_{MAX_STEPS}", TRACKER]


def test_a_failed_commit_leaves_the_tracker_and_older_steps(tmp_path: Path) -> None:
    with pytest.raises(DistributedFailure, match=r"committing .*global_step_4 failed"):
        run_distributed(train, 1, str(tmp_path), "before_commit:ENOSPC", timeout=200)
    assert [n for n in listing(tmp_path) if n != LOCK] == [
        "global_step_2",
        f"global_step_{FAULT_STEP}?",
        TRACKER,
    ]
    assert layout.read_tracker(tmp_path / "ckpt") == 2
    shutil.rmtree(tmp_path / "ckpt" / f"global_step_{FAULT_STEP}")

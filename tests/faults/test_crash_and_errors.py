"""Promises 1 and 3: a killed rank or a failing disk never costs a committed step (promise 2,
preemption, is test_preemption.py).

Every case runs real Trainers in real processes on real files, injects the fault where it
happens (see _faulty.py), then checks which files exist and which step the next
``fit(ckpt_path="last")`` resumes from, and that it continues bit for bit like a run that was
never interrupted.

The shard writer is an axis where a fault strikes it: our writer (``"threads"``, the default)
and Megatron-Core's (``"megatron"``: its writer threads inline, a forked process per async
save), each sync and async, for each kind of fault in a shard write (SIGKILL of the only rank,
SIGKILL of one rank of two, an ``OSError`` raised or counted).
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

from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.storage import atomic
from lightning_mcore_ckpt.storage.lock import LOCK_FILE
from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(300)

LOCK = LOCK_FILE
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
    # The tracker's new contents written to its temporary file, not yet renamed: the same,
    # and the temporary file stays until the next run's commit removes it.
    "in_tracker": (["global_step_2", f"global_step_{FAULT_STEP}"], 4),
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
    left = atomic.leftovers(tmp_path / "ckpt" / TRACKER)
    assert len(left) == (point == "in_tracker"), left
    assert layout.read_tracker(tmp_path / "ckpt") == (resume_at if point == "retention" else 2)
    resumed = run_distributed(train, 1, str(tmp_path), None, timeout=200)[0]
    same_run(resumed, reference, resume_at)
    # max_to_keep=1: only the final step remains; crashed leftovers were cleaned up.
    assert listing(tmp_path) == [f"global_step_{MAX_STEPS}", TRACKER]


# (writer, async save, kill point): with the sync saves of our writer above, every pair of the
# three axes. Megatron-Core's async writer is a forked process: it dies with its rank.
WRITER_KILLS = [
    ("threads", True, "model_shards"),
    ("megatron", False, "optim_shards"),
    ("megatron", True, "model_shards"),
    ("megatron", True, "optim_shards"),
]


def _writer_id(writer: str, async_save: bool) -> str:
    return f"{writer}-{'async' if async_save else 'sync'}"


# Faults on one rank of two: our writer sync, Megatron-Core's async (the other pairs: above, and
# in test_agreement_matrix.py).
TWO_WRITERS = [("threads", False), ("megatron", True)]


@pytest.mark.parametrize(
    ("writer", "async_save", "point"),
    WRITER_KILLS,
    ids=[f"{_writer_id(w, a)}-{p}" for w, a, p in WRITER_KILLS],
)
def test_sigkill_while_either_shard_writer_writes_loses_nothing(
    tmp_path: Path, reference: dict[str, Any], writer: str, async_save: bool, point: str
) -> None:
    options = {"async_save": async_save, "writer": writer}
    with pytest.raises(DistributedFailure, match="exit code -9"):
        run_distributed(train, 1, str(tmp_path), f"{point}:kill", options, timeout=200)
    assert [n for n in listing(tmp_path) if n.startswith("global_step_")] == [
        "global_step_2",
        f"global_step_{FAULT_STEP}?",
    ]
    # Step 2 was written by that writer, in that mode ("mcore": Megatron-Core's own).
    meta = markers.read_metadata(layout.step_dir(tmp_path / "ckpt", 2))
    assert meta is not None and meta["async"] is async_save
    assert meta["writer"] == ("threads" if writer == "threads" else "mcore")
    resumed = run_distributed(train, 1, str(tmp_path), None, options, timeout=200)[0]
    same_run(resumed, reference, 2)
    assert listing(tmp_path) == [f"global_step_{MAX_STEPS}", TRACKER]


@pytest.fixture(scope="module")
def reference_tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted run on 2 ranks (TP=2) with the same saves."""
    tmp = tmp_path_factory.mktemp("reference_tp2")
    return run_distributed(train, 2, str(tmp), None, TP2, timeout=250)[0]


@pytest.mark.parametrize(
    ("writer", "async_save"), TWO_WRITERS, ids=[_writer_id(*w) for w in TWO_WRITERS]
)
def test_sigkill_of_one_rank_of_two_loses_nothing(
    tmp_path: Path, reference_tp2: dict[str, Any], writer: str, async_save: bool
) -> None:
    options = {**TP2, "async_save": async_save, "writer": writer}
    run = str(tmp_path / "run")
    # The killed rank takes the job down (it dies, or its peer's collective fails): the job
    # fails, it does not hang; whichever message the transport gives is not ours to assert.
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(train, 2, run, "optim_shards:kill@1", options, timeout=250)
    assert "did not finish within" not in str(failure.value)
    assert [n for n in listing(run) if n.startswith("global_step_")] == [
        "global_step_2",
        f"global_step_{FAULT_STEP}?",
    ]
    resumed = run_distributed(train, 2, run, None, options, timeout=250)[0]
    same_run(resumed, reference_tp2, 2)


def _failed_metric(path: str) -> list[tuple[int, float]]:
    with open(path) as f:
        return [
            (int(r["step"]), float(r["checkpoint/failed"]))
            for r in csv.DictReader(f)
            if r.get("checkpoint/failed")
        ]


@pytest.mark.parametrize(
    ("writer", "async_save"), TWO_WRITERS, ids=[_writer_id(*w) for w in TWO_WRITERS]
)
def test_write_error_on_one_rank_raises_on_every_rank(
    tmp_path: Path, writer: str, async_save: bool
) -> None:
    options = {**TP2, "async_save": async_save, "writer": writer}
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(train, 2, str(tmp_path), "model_shards:ENOSPC@1", options, timeout=250)
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


WARN_CASES = [
    ("model_shards:EIO", "threads", True),
    ("before_commit:EACCES", "threads", True),
    ("model_shards:EIO", "megatron", False),
    ("model_shards:EIO", "megatron", True),
]


@pytest.mark.parametrize(
    ("fault", "writer", "async_save"),
    WARN_CASES,
    ids=["async-write-EIO", "commit-EACCES", "megatron-sync-write-EIO", "megatron-async-write-EIO"],
)
def test_on_save_error_warn_counts_the_failure_and_keeps_training(
    tmp_path: Path, fault: str, writer: str, async_save: bool
) -> None:
    options = {"async_save": async_save, "writer": writer, "on_save_error": "warn"}
    run = run_distributed(
        train, 1, str(tmp_path), fault, {**options, "max_to_keep": 1}, timeout=200
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

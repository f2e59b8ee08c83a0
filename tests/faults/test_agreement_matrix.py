"""Promise 11: a failing save is the same error on every rank, within seconds, never a hang.

The matrix: failure point x failing rank x sync/async, on 2 real processes (TP=2: both ranks
write shards). Points only global rank 0 reaches (Megatron-Core's finalisation writes each
dist-checkpoint's ``.metadata`` and ``metadata.json`` there; our commit thread writes the commit
marker and the tracker, and applies retention) are failed on rank 0; points every rank reaches
(shards, ``extra/``) on each rank. For each cell: what *every* rank raised, and what is on disk.

Each row's runs follow one another in the same two processes, as a job that saves again after
a failed save (``on_save_error="warn"``, or a retried fit) would: every cell also checks that
the step saved before the failure, in the same processes, is undamaged (Megatron-Core's writers
keep their results in one queue per process; a failed save's leftovers must not end up in the
next save's index).

The process group's timeout is 120 s in these runs, so a rank left waiting would fail with the
transport's timeout (not our error) and the cell would fail; the runs of one row share their
processes, so a hang anywhere fails the row (the launcher's limit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _faulty import FAULT_STEP, MAX_STEPS, listing, run_cases

from lightning_mcore_ckpt import layout
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(900)

LOCK, TRACKER = layout.LOCK_FILE, layout.TRACKER_FILE
STEP = f"global_step_{FAULT_STEP}"

# point -> (injected error, failing ranks, what every rank's error says, steps on disk after)
RAISING = {
    "model_shards": ("EIO", (0, 1), "Input/output error", ["global_step_2", f"{STEP}?"]),
    "extra": ("EIO", (0, 1), "Input/output error", ["global_step_2", f"{STEP}?"]),
    "dcp_metadata": ("ENOSPC", (0,), "No space left on device", ["global_step_2", f"{STEP}?"]),
    "mcore_config": ("ENOSPC", (0,), "No space left on device", ["global_step_2", f"{STEP}?"]),
    "before_commit": ("ENOSPC", (0,), "No space left on device", ["global_step_2", f"{STEP}?"]),
    # The marker is written: the step is complete (durable) though the tracker still says 2.
    "before_tracker": ("ENOSPC", (0,), "No space left on device", ["global_step_2", STEP]),
}
CELLS = [
    (f"{point}@{rank}", f"{point}:{error}@{rank}")
    for point, (error, ranks, _, _) in RAISING.items()
    for rank in ranks
] + [("retention@0", "retention:once-EACCES@0")]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def outcomes(
    request: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[dict[str, dict[str, Any]]]]:
    tmp = tmp_path_factory.mktemp("matrix")
    common = {"tp": 2, "async_save": request.param, "ckpt_path": None, "group_timeout_s": 120}
    cases = [
        (cell, fault, {**common, "max_to_keep": 1 if cell.startswith("retention") else None})
        for cell, fault in CELLS
    ]
    return tmp, run_distributed(run_cases, 2, str(tmp), cases, timeout=840)


@pytest.mark.parametrize("cell", [cell for cell, _ in CELLS if not cell.startswith("retention")])
def test_every_rank_raises_the_same_error_and_nothing_committed_is_lost(
    outcomes: tuple[Path, list[dict[str, dict[str, Any]]]], cell: str
) -> None:
    tmp, per_rank = outcomes
    point = cell.split("@")[0]
    _, _, cause, on_disk = RAISING[point]
    messages = set()
    for rank, results in enumerate(per_rank):
        got = results[cell]
        assert got["raised"] == "CheckpointSaveError", (rank, got)
        assert STEP in got["message"] and cause in got["message"], (rank, got["message"])
        messages.add(got["message"])
    assert len(messages) == 1, messages  # the same error, word for word, on every rank
    run = tmp / cell
    assert [n for n in listing(run) if n != TRACKER] == on_disk  # and the lock was released
    assert layout.read_tracker(run / "ckpt") == 2
    assert layout.verify_step(layout.step_dir(run / "ckpt", 2)) == []


def test_a_retention_failure_is_logged_and_training_goes_on(
    outcomes: tuple[Path, list[dict[str, dict[str, Any]]]],
) -> None:
    tmp, per_rank = outcomes
    for results in per_rank:
        assert results["retention@0"] == {"raised": None, "end": MAX_STEPS}
    # Deleting step 2 failed halfway once (its marker went first: it is incomplete, not
    # damaged); the next commit's retention cleaned it up.
    run = tmp / "retention@0"
    assert listing(run) == [f"global_step_{MAX_STEPS}", TRACKER]
    assert layout.read_tracker(run / "ckpt") == MAX_STEPS

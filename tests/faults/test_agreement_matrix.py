"""Promise 11: a failing save is the same error on every rank, within seconds, never a hang.

The matrix: failure point x failing rank x sync/async x writer, on 2 real processes (TP=2: both ranks
write shards). Points only global rank 0 reaches (Megatron-Core's finalisation writes each
dist-checkpoint's ``.metadata`` and ``metadata.json`` there; our commit thread writes the commit
marker and the tracker, and applies retention) are failed on rank 0; points every rank reaches
(shards, ``extra/``) on each rank. For each cell: what *every* rank raised, and what is on disk.

Each row's runs follow one another in the same two processes, as a job that saves again after
a failed save (``on_save_error="warn"``, or a retried fit) would: every cell also checks that
the step saved before the failure, in the same processes, is undamaged (Megatron-Core's writers
keep their results in one queue per process; a failed save's leftovers must not end up in the
next save's index).

The shard writer is an axis of the cells a writer takes part in: the shard writes and
Megatron-Core's finalisation of them (``.metadata``, ``metadata.json``) are failed in our writer
(``"threads"``) and in Megatron-Core's (``"megatron"``), each sync and async; ``extra/``, the
commit marker, the tracker and retention are written by this package whatever the writer.

"Within seconds" is asserted: every rank raised within :data:`WITHIN_S` of the first injected
error (wall-clock times, recorded by each process of the one machine: ``fault_events.jsonl``
and ``raised_at``), while the process group's timeout is 300 s. A rank that waited for the
timeout fails the cell; a slow machine does not (a step of these runs takes well under a
second). The runs of one row share their processes, so a hang anywhere fails the row (the
launcher's limit).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _faulty import FAULT_STEP, MAX_STEPS, events, listing, run_cases

from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.storage.lock import LOCK_FILE
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(900)

LOCK, TRACKER = LOCK_FILE, layout.TRACKER_FILE
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
WRITER_POINTS = ("model_shards", "dcp_metadata", "mcore_config")
"""The points in a shard writer or in Megatron-Core's finalisation of what it wrote."""

GROUP_TIMEOUT_S = 300
WITHIN_S = 60
"""Every rank raises within this of the failure: far below the process group's timeout."""

# row -> (writer, async save, its cells)
ROWS = {
    "threads-sync": ("threads", False, CELLS),
    "threads-async": ("threads", True, CELLS),
    "megatron-sync": ("megatron", False, [c for c in CELLS if c[0].startswith(WRITER_POINTS)]),
    "megatron-async": ("megatron", True, [c for c in CELLS if c[0].startswith(WRITER_POINTS)]),
}
Outcomes = tuple[Path, list[dict[str, dict[str, Any]]]]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Outcomes]:
    """A row's outcomes: its cells, one after the other, in the same 2 processes (once a row)."""
    done: dict[str, Outcomes] = {}

    def row(name: str) -> Outcomes:
        if name not in done:
            writer, async_save, cells = ROWS[name]
            tmp = tmp_path_factory.mktemp(f"matrix-{name}")
            common = {
                "tp": 2,
                "async_save": async_save,
                "writer": writer,
                "ckpt_path": None,
                "group_timeout_s": GROUP_TIMEOUT_S,
            }
            cases = [
                (
                    cell,
                    fault,
                    {**common, "max_to_keep": 1 if cell.startswith("retention") else None},
                )
                for cell, fault in cells
            ]
            done[name] = tmp, run_distributed(run_cases, 2, str(tmp), cases, timeout=840)
        return done[name]

    return row


RAISING_CELLS = [
    (row, cell)
    for row, (_, _, cells) in ROWS.items()
    for cell, _ in cells
    if not cell.startswith("retention")
]


@pytest.mark.parametrize(
    ("row", "cell"), RAISING_CELLS, ids=[f"{row}-{cell}" for row, cell in RAISING_CELLS]
)
def test_every_rank_raises_the_same_error_within_seconds_and_nothing_committed_is_lost(
    matrix: Callable[[str], Outcomes], row: str, cell: str
) -> None:
    tmp, per_rank = matrix(row)
    point = cell.split("@")[0]
    _, _, cause, on_disk = RAISING[point]
    run = tmp / cell
    fired = [e["at"] for e in events(run) if e["event"] == "fired"]
    assert fired, f"the fault of {cell} never struck"
    messages = set()
    for rank, results in enumerate(per_rank):
        got = results[cell]
        assert got["raised"] == "CheckpointSaveError", (rank, got)
        assert STEP in got["message"] and cause in got["message"], (rank, got["message"])
        messages.add(got["message"])
        # Within seconds of the failure, not after the process group's timeout.
        waited = got["raised_at"] - min(fired)
        assert 0 <= waited <= WITHIN_S, f"rank {rank} raised {waited:.1f} s after the failure"
    assert len(messages) == 1, messages  # the same error, word for word, on every rank
    assert [n for n in listing(run) if n != TRACKER] == on_disk  # and the lock was released
    assert layout.read_tracker(run / "ckpt") == 2
    assert layout.verify_step(layout.step_dir(run / "ckpt", 2)) == []


@pytest.mark.parametrize("row", ["threads-sync", "threads-async"])
def test_a_retention_failure_is_logged_and_training_goes_on(
    matrix: Callable[[str], Outcomes], row: str
) -> None:
    tmp, per_rank = matrix(row)
    for results in per_rank:
        assert results["retention@0"] == {"raised": None, "end": MAX_STEPS}
    # Deleting step 2 failed halfway once (its marker went first: it is incomplete, not
    # damaged); the next commit's retention cleaned it up.
    run = tmp / "retention@0"
    assert listing(run) == [f"global_step_{MAX_STEPS}", TRACKER]
    assert layout.read_tracker(run / "ckpt") == MAX_STEPS

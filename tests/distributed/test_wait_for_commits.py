"""``MegatronCheckpoint.wait_for_commits``: a script's way to wait until a step is committed.

A callback waits for step 2's commit at the start of the next batch (Lightning runs checkpoint
callbacks after the others, so step 2's save has started by then).

``strategy.finalize_pending_save(blocking=True)`` returns once an async save's files are
written; the commit marker and the tracker are written later, by rank 0's commit thread. Here
the commit thread is slowed down (one second before each commit), so that the files are
written long before the step is committed: right after the finalisation the step is not yet
complete, and after ``wait_for_commits`` it is, on every rank, with the tracker naming it.
Sync and async saves.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


def _fit(rank: int, world_size: int, tmp: str, async_save: bool) -> list[dict[str, Any]]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.callback import _commit
    from lightning_mcore_ckpt.format import layout
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    original = _commit.Committer._commit

    def slow_commit(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return original(self, *args, **kwargs)

    _commit.Committer._commit = slow_commit  # type: ignore[method-assign]
    root = Path(tmp, "ckpt")
    checkpoint = MegatronCheckpoint(root, every_n_train_steps=2)
    seen: list[dict[str, Any]] = []

    class Waiter(pl.Callback):
        # Lightning runs checkpoint callbacks last: at the next batch's start, step 2's save has
        # been started.
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step != 2:
                return
            trainer.strategy.finalize_pending_save(blocking=True)
            step = layout.step_dir(root, 2)
            written = layout.is_complete(step)
            committed = checkpoint.wait_for_commits(trainer)
            seen.append(
                {
                    "complete_after_finalize": written,
                    "returned": committed,
                    "complete": layout.is_complete(step),
                    "tracker": layout.read_tracker(root),
                }
            )

    trainer = make_trainer(
        3,
        MegatronStrategy(ckpt_async_save=async_save),
        world_size,
        callbacks=[checkpoint, Waiter()],
        enable_checkpointing=True,
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(16))
    return seen


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_wait_for_commits_returns_once_the_step_is_committed_on_every_rank(
    tmp_path: Path, async_save: bool
) -> None:
    ranks = run_distributed(_fit, 2, str(tmp_path), async_save, timeout=240)
    for seen in ranks:
        (record,) = seen
        assert not record["complete_after_finalize"], record  # files written, not committed
        assert record["returned"] == 2 and record["complete"] and record["tracker"] == 2, record

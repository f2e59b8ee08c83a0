"""What a run does when it fails around a save, on every rank, and what stays on disk.

- A training error while an async save is being written: the run's own error propagates (on
  the ranks that raised it), the save in flight is stopped and left uncommitted, the lock is
  released, and nothing writes into the step afterwards.
- A training error while a step whose async write had finished is being committed (rank 0's
  commit thread): the step still commits (or, when its commit fails, is counted in
  ``checkpoint/failed`` with ``on_save_error="warn"``); the run's own error propagates on every
  rank, and the lock is released after the commit.
- ``ckpt_path="last"`` when rank 0 finds every step damaged: every rank raises the same error
  (before, rank 0 started from scratch while the others loaded a step, and the job hung).
- A Hugging Face export that fails: the step was committed first and stays; the error is loud,
  on every rank. A preemption save is never exported.
- Saves made by hand into the run directory, and links there, are never deleted.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _faulty import FAULT_STEP, listing, run, train

from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.storage.lock import LOCK_FILE
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(600)

LOCK, TRACKER = LOCK_FILE, layout.TRACKER_FILE


def _own_sizes(step: Path, rank: int) -> dict[str, int]:
    # This rank's shard files (``__<rank>_<n>.distcp``): its own writer's, and nobody else's.
    return {str(p.relative_to(step)): p.stat().st_size for p in step.rglob(f"__{rank}_*")}


def _fail_while_writing(
    rank: int, world_size: int, tmp: str, fault: str, options: dict[str, Any]
) -> dict[str, Any]:
    step = layout.step_dir(Path(tmp, "ckpt"), FAULT_STEP)
    try:
        run(rank, world_size, tmp, fault, **options)
    except Exception as err:  # noqa: BLE001 - what each rank raised is the subject
        then = _own_sizes(step, rank)
        lock_held = (Path(tmp, "ckpt") / LOCK).exists()
        time.sleep(6)  # longer than the slowed write: a writer left running would change it
        return {
            "raised": type(err).__name__,
            "message": str(err),
            "lock_held": lock_held,
            "then": then,
            "later": _own_sizes(step, rank),
        }
    return {"raised": None}


@pytest.mark.parametrize("failing", [None, 1], ids=["every-rank", "rank-1-only"])
def test_an_error_during_an_async_write_propagates_and_leaves_the_step_uncommitted(
    tmp_path: Path, failing: int | None
) -> None:
    # Step 4's background write is slowed on both ranks; training fails after step 5, while
    # it is still being written.
    options = {
        "tp": 2,
        "async_save": True,
        "max_to_keep": None,
        "ckpt_path": None,
        "raise_at": (5, failing),
        "group_timeout_s": 60,
    }
    results = run_distributed(
        _fail_while_writing, 2, str(tmp_path), "model_shards:slow", options, timeout=400
    )
    for rank, got in enumerate(results):
        if failing is None or rank == failing:
            # The run's own error, not a checkpoint error in its place.
            assert got["raised"] == "RuntimeError", got
            assert got["message"] == "training failed at step 5 (injected)"
        else:
            assert got["raised"] is not None  # its peer is gone: it fails, it does not hang
        # Its background writer was stopped before fit raised: it wrote nothing more.
        assert got["then"] == got["later"], got
    assert not results[0]["lock_held"]  # released before the error left fit
    assert [n for n in listing(tmp_path) if n != TRACKER] == ["global_step_2", "global_step_4?"]
    assert layout.read_tracker(tmp_path / "ckpt") == 2


# --- a training error while a finished step is being committed -------------------------------

COMMITTING = 4
"""The step whose commit is under way when training fails (an async save; step 2 before it)."""
COMMIT_DELAY_S = 5.0
"""How long rank 0's commit thread waits before committing it: training fails meanwhile."""


def _fail_while_committing(
    rank: int, world_size: int, tmp: str, cases: list[tuple[str, str, bool]]
) -> dict[str, dict[str, Any]]:
    """Per ``(case, on_save_error, commit_fails)``, a run in its own directory (see
    :func:`_fit_failing_while_committing`), in the same processes."""
    import errno

    from lightning_mcore_ckpt.callback._commit import Committer
    from lightning_mcore_ckpt.storage import atomic as _atomic

    commit, write_text = Committer._commit, _atomic.write_text
    failing: list[bool] = [False]

    def held_commit(self: Any, target: Path, *args: Any) -> Any:
        if target.name == f"global_step_{COMMITTING}":
            time.sleep(COMMIT_DELAY_S)  # before anything of the commit, the lock check included
        return commit(self, target, *args)

    def marker_write(path: Any, text: str) -> None:
        marker = Path(path).name == markers.METADATA_FILE
        if failing[0] and marker and Path(path).parent.name == f"global_step_{COMMITTING}":
            raise OSError(errno.EACCES, "Permission denied (injected in the commit marker)")
        write_text(path, text)

    Committer._commit = held_commit  # type: ignore[method-assign]
    _atomic.write_text = marker_write  # type: ignore[assignment]
    outcomes = {}
    for case, on_save_error, commit_fails in cases:
        failing[0] = commit_fails
        outcomes[case] = _fit_failing_while_committing(world_size, Path(tmp, case), on_save_error)
    return outcomes


def _fit_failing_while_committing(
    world_size: int, directory: Path, on_save_error: str
) -> dict[str, Any]:
    """TP=2, async saves every 2 steps: training raises on every rank at the first batch end
    where the save of step 4 is written and finalised everywhere, its commit handed to rank 0's
    commit thread (held back by the caller)."""
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    root = directory / "ckpt"
    step = layout.step_dir(root, COMMITTING)
    callback = MegatronCheckpoint(root, every_n_train_steps=2, on_save_error=on_save_error)
    seen: dict[str, Any] = {}

    class FailOnceHandedToTheCommit(pl.Callback):
        # Lightning calls checkpoint callbacks last: this runs before a save of the same batch.
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            writer = trainer.strategy._writer  # type: ignore[attr-defined]
            if writer.pending_path == step:  # saved at the last batch end: its write, done
                for _id, future, _request in writer._async_queue._calls:
                    future.result(timeout=120)
            # Finalised at this batch's start, on every rank at once: its commit is awaited.
            assert callback._committer is not None
            if step in callback._committer._awaiting:
                seen["complete_at_the_error"] = layout.is_complete(step)
                raise RuntimeError(f"training failed at step {trainer.global_step} (injected)")

    trainer = make_trainer(
        8,
        MegatronStrategy(tensor_model_parallel_size=2, ckpt_async_save=True),
        world_size,
        callbacks=[callback, FailOnceHandedToTheCommit()],
        enable_checkpointing=True,
        logger=CSVLogger(directory, name="csv", version=0),
        log_every_n_steps=1,
        default_root_dir=directory,
    )
    torch.manual_seed(0)
    try:
        trainer.fit(TinyGPTModule(), train_dataloaders=loader(64, 2))
    except Exception as err:  # noqa: BLE001 - what each rank raised is the subject
        seen.update(raised=type(err).__name__, message=str(err))
    seen.update(
        failed_saves=callback.failed_saves,
        lock_held=(root / LOCK).exists(),
        csv=str(directory / "csv" / "version_0" / "metrics.csv"),
    )
    return seen


def _logged(csv_file: str, metric: str) -> dict[int, float]:
    import csv

    with open(csv_file) as f:
        return {int(r["step"]): float(r[metric]) for r in csv.DictReader(f) if r.get(metric)}


def test_a_training_error_while_a_written_step_commits_lets_it_commit_or_counts_its_failure(
    tmp_path: Path,
) -> None:
    # The matrix: the commit succeeds or fails (EACCES writing its marker) x on_save_error.
    cases = [
        (f"{outcome}-{mode}", mode, outcome == "fails")
        for outcome in ("commits", "fails")
        for mode in ("raise", "warn")
    ]
    results = run_distributed(_fail_while_committing, 2, str(tmp_path), cases, timeout=500)
    for case, mode, commit_fails in cases:
        got = [r[case] for r in results]
        for rank, seen in enumerate(got):
            # The run's own error on every rank, at the same step, never a checkpoint error.
            assert seen["raised"] == "RuntimeError", (case, rank, seen)
            # Written at step 4's end; finalised at the start of the first step by which its
            # write is done everywhere: step 5 when it was that fast, else step 6 (the error
            # callback waits for the write at step 5's end). The same step on every rank.
            assert seen["message"] == got[0]["message"], (case, rank, seen)
            assert seen["message"] in {
                f"training failed at step {COMMITTING + k} (injected)" for k in (1, 2)
            }, (case, rank, seen)
            # The step's write had finished everywhere; its commit had not happened yet.
            assert seen["complete_at_the_error"] is False, (case, rank, seen)
        root = tmp_path / case / "ckpt"
        step = layout.step_dir(root, COMMITTING)
        assert not got[0]["lock_held"], case  # released once the commit was over
        assert LOCK not in listing(tmp_path / case)
        size = _logged(got[0]["csv"], "checkpoint/size_bytes")
        if not commit_fails:  # it committed, during the error: complete, whole, "last"
            assert layout.is_complete(step) and layout.verify_step(step) == [], case
            assert layout.read_tracker(root) == COMMITTING, case
            assert sorted(size) == [2, COMMITTING], case  # and its figures were logged
            assert got[0]["failed_saves"] == 0, case
        else:
            assert not layout.is_complete(step), case
            assert layout.read_tracker(root) == 2, case  # the previous step stays "last"
            assert sorted(size) == [2], case
            failed = _logged(got[0]["csv"], "checkpoint/failed")
            if mode == "warn":  # counted (by rank 0, which commits), at the step of the save
                assert got[0]["failed_saves"] == 1, case
                assert failed == {COMMITTING: 1.0}, case
            else:  # "raise": the run's error is the one raised; nothing is counted
                assert got[0]["failed_saves"] == 0 and failed == {}, case


def _resume(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    try:
        return run(rank, world_size, tmp, None, tp=2, max_to_keep=None, group_timeout_s=60)
    except Exception as err:  # noqa: BLE001 - what each rank raised is the subject
        return {"raised": type(err).__name__, "message": str(err)}


def test_every_rank_agrees_when_rank_0_finds_every_step_damaged(tmp_path: Path) -> None:
    options = {"tp": 2, "max_steps": 4, "max_to_keep": None}
    run_distributed(train, 2, str(tmp_path), None, options, timeout=300)
    root = tmp_path / "ckpt"
    for step in layout.complete_steps(root):
        os.truncate(sorted((step.path / "model").glob("*.distcp"))[0], 10)
    results = run_distributed(_resume, 2, str(tmp_path), timeout=300)
    messages = {r.get("message") for r in results}
    assert len(messages) == 1, results  # the same error on both ranks
    (message,) = messages
    assert results[0]["raised"] == "FileNotFoundError"
    assert f"every complete step under {root} is damaged" in str(message)
    assert "global_step_2: " in str(message) and "global_step_4: " in str(message)


# --- Hugging Face export -------------------------------------------------------------------


def _fit_with_export(
    rank: int, world_size: int, tmp: str, when: str, signal_at: int | None, broken: bool
) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import HFExport, MegatronCheckpoint, MegatronStrategy, hf
    from lightning_mcore_ckpt.tiny import HFGPTModule

    if broken:
        real = hf.export_checkpoint

        def export_checkpoint(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)  # the export is written, then fails (e.g. the disk fills)
            raise OSError(28, "No space left on device (injected in the export)")

        hf.export_checkpoint = export_checkpoint  # type: ignore[assignment]

    class Signal(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == signal_at and rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)

    src = str(Path(tmp, "src"))
    trainer = make_trainer(
        4,
        MegatronStrategy(tensor_model_parallel_size=world_size, init_from=src),
        world_size,
        callbacks=[
            MegatronCheckpoint(
                Path(tmp, "ckpt"), every_n_train_steps=2, hf_export=HFExport(src, when=when)
            ),
            Signal(),
        ],
        enable_checkpointing=True,
    )
    try:
        trainer.fit(HFGPTModule(src), train_dataloaders=loader(32, 2))
    except Exception as err:  # noqa: BLE001 - what each rank raised is the subject
        return {"raised": type(err).__name__, "message": str(err)}
    return {"raised": None, "end": trainer.global_step}


def test_a_failed_final_export_is_loud_everywhere_and_the_step_stays(tmp_path: Path) -> None:
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", family="qwen2")
    results = run_distributed(_fit_with_export, 2, str(tmp_path), "end", None, True, timeout=400)
    for got in results:
        assert got["raised"] == "CheckpointSaveError", got
        assert "the Hugging Face export of" in got["message"] and "global_step_4" in got["message"]
        assert "committed and intact" in got["message"] and "No space left" in got["message"]
    root = tmp_path / "ckpt"
    final = layout.step_dir(root, 4)
    assert layout.is_complete(final) and layout.verify_step(final) == []
    assert layout.read_tracker(root) == 4
    assert "hf_model" not in markers.read_metadata(final)["contents"]  # type: ignore[index]
    assert LOCK not in listing(tmp_path)


def test_a_preemption_save_is_not_exported(tmp_path: Path) -> None:
    from lightning_mcore_ckpt import hf
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    tiny_hf_model(tmp_path / "src", family="qwen2")
    (got,) = run_distributed(
        _fit_with_export, 1, str(tmp_path), "every_save", 3, False, timeout=300
    )
    assert got == {"raised": None, "end": 3}
    root = tmp_path / "ckpt"
    assert [s.step for s in layout.complete_steps(root)] == [2, 3]
    assert hf.is_exported(layout.step_dir(root, 2))  # every save, by the cadence
    assert not hf.is_exported(layout.step_dir(root, 3))  # the preemption save: not exported
    assert not (layout.step_dir(root, 3) / layout.HF_DIR).exists()


# --- saves by hand, links ------------------------------------------------------------------


def _fit_and_save_by_hand(rank: int, world_size: int, tmp: str, max_steps: int) -> None:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    root = Path(tmp, "ckpt")
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(tensor_model_parallel_size=world_size),
        world_size,
        callbacks=[MegatronCheckpoint(root, every_n_train_steps=2, max_to_keep=1)],
        enable_checkpointing=True,
    )
    torch.manual_seed(0)
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(64, 2), ckpt_path="last")
    if max_steps == 4:
        trainer.save_checkpoint(root / "global_step_1")  # by hand, under a step's name
        trainer.save_checkpoint(root / "for_eval")


def test_saves_by_hand_and_links_in_the_run_directory_are_never_deleted(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_distributed(_fit_and_save_by_hand, 2, str(tmp_path), 4, timeout=300)
    for name in ("global_step_1", "for_eval"):  # committed by the save itself
        meta = markers.read_metadata(root / name)
        assert meta is not None and meta["manual"] is True and meta["global_step"] == 4
        assert layout.verify_step(root / name) == []
    # A link to a step of another run, named like one of ours.
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(layout.step_dir(root, 4), elsewhere / "global_step_3")
    (root / "global_step_3").symlink_to(elsewhere / "global_step_3")
    run_distributed(_fit_and_save_by_hand, 2, str(tmp_path), 8, timeout=300)
    # max_to_keep=1 kept the newest step of the run, and nothing else was touched.
    assert listing(tmp_path) == [
        "for_eval",
        "global_step_1",
        "global_step_3",
        "global_step_8",
        TRACKER,
    ]
    assert (root / "global_step_3").is_symlink()
    assert layout.verify_step(elsewhere / "global_step_3") == []
    assert layout.verify_step(root / "global_step_1") == []

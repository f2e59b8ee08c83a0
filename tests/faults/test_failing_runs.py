"""What a run does when it fails around a save, on every rank, and what stays on disk.

- A training error while an async save is being written: the run's own error propagates (on
  the ranks that raised it), the save in flight is stopped and left uncommitted, the lock is
  released, and nothing writes into the step afterwards.
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

from lightning_mcore_ckpt import layout
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(600)

LOCK, TRACKER = layout.LOCK_FILE, layout.TRACKER_FILE


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
    assert "hf_model" not in layout.read_metadata(final)["contents"]  # type: ignore[index]
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
        meta = layout.read_metadata(root / name)
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

"""GPU tier: async saves through NVIDIA's resiliency extension resume exactly (1 GPU), and a
worker that died fails the save it held on every rank instead of leaving them waiting.

Runs where CUDA and a compatible nvidia-resiliency-ext (>= 0.6, megatron-core 0.19) are
installed; elsewhere the built-in writer is used and this test skips.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt import _compat, check_resume
from lightning_mcore_ckpt.format import markers
from lightning_mcore_ckpt.resume_check import ResumeJob
from lightning_mcore_ckpt.testing import run_distributed


def _nvrx_usable() -> bool:
    return torch.cuda.is_available() and _compat.async_strategy() == _compat.NVRX


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not _nvrx_usable(),
        reason="needs nvidia-resiliency-ext >= 0.6 with megatron-core 0.19",
    ),
]


def build(dirpath: str, async_save: bool = True) -> ResumeJob:
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=MegatronStrategy(ckpt_async_save=async_save, ckpt_writer="megatron"),
        accelerator="gpu",
        devices=1,
        max_steps=100,
        # check_resume points it at each run's own directory; this one (under the test's
        # tmp_path) is never written.
        callbacks=[MegatronCheckpoint(dirpath, every_n_train_steps=2)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    generator = torch.Generator().manual_seed(0)
    loader: Any = StatefulDataLoader(
        TokenDataset(32), batch_size=2, shuffle=True, generator=generator
    )
    return ResumeJob(trainer, TinyGPTModule(dropout=0.1), train_dataloaders=loader)


def test_async_saves_through_nvrx_resume_exactly(tmp_path: Path) -> None:
    report = check_resume(
        functools.partial(build, str(tmp_path / "job")),
        stop_at=4,
        max_steps=7,
        how=("sigterm", "kill"),
        world_size=1,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
    for how in ("sigterm", "kill"):
        metadata = markers.read_metadata(tmp_path / "work" / how / "checkpoints" / "global_step_4")
        assert metadata is not None and metadata["writer"] == _compat.NVRX, metadata


def _worker_killed(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Async saves through NVRx every 2 steps; after the save of step 2 is finalised, the
    persistent worker is killed (SIGKILL, as the kernel's OOM killer would): the save of step 4
    goes to a dead worker, and the save of step 6 waits for it."""
    import os
    import signal

    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import CheckpointSaveError, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset

    seen: dict[str, Any] = {}

    class KillWorker(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                writer = trainer.strategy._writer
                writer.finalize(blocking=True)  # step 2 committed first
                process = writer._async_queue.persistent_caller.process
                os.kill(process.pid, signal.SIGKILL)
                process.join(30)
                seen["killed"] = process.exitcode

    trainer = pl.Trainer(
        strategy=MegatronStrategy(ckpt_async_save=True, ckpt_writer="megatron"),
        accelerator="gpu",
        devices=1,
        max_steps=6,
        callbacks=[MegatronCheckpoint(Path(root, "ckpt"), every_n_train_steps=2), KillWorker()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(TinyGPTModule(dropout=0.0), StatefulDataLoader(TokenDataset(32), batch_size=2))
        seen["error"] = None
    except CheckpointSaveError as err:
        seen["error"] = str(err)
    return seen


def test_a_dead_nvrx_worker_fails_the_save_it_held_instead_of_hanging(tmp_path: Path) -> None:
    (seen,) = run_distributed(_worker_killed, 1, str(tmp_path), timeout=300)
    assert seen["killed"] == -9, seen
    error = seen["error"] or ""
    assert "global_step_4" in error and "ended with exit code -9" in error, seen
    steps = tmp_path / "ckpt"
    assert markers.read_metadata(steps / "global_step_2") is not None
    assert markers.read_metadata(steps / "global_step_4") is None

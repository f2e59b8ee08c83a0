"""Async saves: staged snapshot, background write, finalisation, loud failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

SAVE_STEP = 2
TOTAL_STEPS = 5


WRITERS = pytest.mark.parametrize("writer", ["threads", "megatron"])
"""Ours (a persistent thread pool of each rank) and Megatron-Core's own (a forked process)."""


def _async_save_during_training(
    rank: int, world_size: int, step_dir: str, writer: str
) -> dict[str, object]:
    import lightning.pytorch as pl
    from _trainer import gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy, SaveOptions
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    out: dict[str, object] = {"records": []}

    class SaveAsync(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step != SAVE_STEP:
                return
            out["at_save"] = gathered_weights(trainer)
            done = out["records"]
            trainer.save_checkpoint(
                step_dir,
                storage_options=SaveOptions(
                    on_finalized=[
                        lambda record: done.append((module.step_losses.__len__(), record))
                    ]
                ),
            )
            out["steps_when_save_returned"] = len(module.step_losses)

    module = TinyGPTModule()
    trainer = make_trainer(
        TOTAL_STEPS,
        MegatronStrategy(tensor_model_parallel_size=2, ckpt_async_save=True, ckpt_writer=writer),
        world_size,
        callbacks=[SaveAsync()],
    )
    trainer.fit(module, train_dataloaders=loader(32, 2, shuffle=True))
    out["at_end"] = gathered_weights(trainer)
    return out


def _load_weights(rank: int, world_size: int, step_dir: str) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import tiny_gpt
    from lightning_mcore_ckpt.training import parallel as _parallel

    _parallel.initialize(tensor_model_parallel_size=1, device_type="cpu")
    module = torch.nn.Module()
    module.gpt = tiny_gpt()
    from lightning_mcore_ckpt.engine import module_sharded_state_dict

    state = dist_checkpointing.load(module_sharded_state_dict(module), f"{step_dir}/model")
    module.load_state_dict(state)
    return gather_sharded(module_sharded_state_dict(module))


@WRITERS
def test_async_save_writes_the_values_of_the_save_step(tmp_path: Path, writer: str) -> None:
    step_dir = str(tmp_path / f"global_step_{SAVE_STEP}")
    results = run_distributed(_async_save_during_training, 2, step_dir, writer, timeout=200)
    (on_disk,) = run_distributed(_load_weights, 1, step_dir, timeout=120)

    for r in results:
        ((steps_at_commit, record),) = r["records"]
        assert record.asynchronous is True
        assert (record.writer == "threads") == (writer == "threads"), record
        # Control came back before the write was committed, and training went on meanwhile.
        assert r["steps_when_save_returned"] == SAVE_STEP
        assert steps_at_commit >= SAVE_STEP
        assert 0 < record.blocking_time_s < record.total_time_s
    at_save, at_end = results[0]["at_save"], results[0]["at_end"]
    assert any(not torch.equal(at_save[k], at_end[k]) for k in at_save), "training did not move"
    for key, tensor in at_save.items():
        assert torch.equal(on_disk[key], tensor), f"{key}: file holds post-save values"


def _failing_background_write(rank: int, world_size: int, step_dir: str, writer: str) -> str:
    import errno

    import lightning.pytorch as pl
    from _trainer import loader, make_trainer
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from lightning_mcore_ckpt import CheckpointSaveError, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    if rank == 1:  # the disk of one rank fills up while the background writer runs

        def no_space(*args: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        filesystem_async._write_item = no_space

    class SaveAsync(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == SAVE_STEP:
                trainer.save_checkpoint(step_dir)

    trainer = make_trainer(
        TOTAL_STEPS,
        MegatronStrategy(tensor_model_parallel_size=2, ckpt_async_save=True, ckpt_writer=writer),
        world_size,
        callbacks=[SaveAsync()],
    )
    try:
        trainer.fit(TinyGPTModule(), train_dataloaders=loader(32, 2))
    except CheckpointSaveError as err:
        return str(err)
    return "no error"


@WRITERS
def test_async_background_write_failure_is_raised_naming_the_step(
    tmp_path: Path, writer: str
) -> None:
    step_dir = str(tmp_path / f"global_step_{SAVE_STEP}")
    messages = run_distributed(_failing_background_write, 2, step_dir, writer, timeout=200)
    for message in messages:
        assert f"global_step_{SAVE_STEP}" in message, message
        assert "failed in the background write" in message

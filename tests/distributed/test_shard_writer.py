"""Our shard writer across saves: one thread pool and one background thread per rank for the
whole run, staging buffers allocated once, plans reused until the structure changes, and a
failed background write reported at its own save while the writer goes on.

Axes: writer lifetime (first save, later saves, after a failure) x structure (constant, a
tensor added) x where it changes (every rank, one rank) x sync/async, on 2 gloo ranks: with data
parallelism (the replicated tensors' writers are assigned by Megatron-Core's fully parallel
save, whose assignment is cached too) when every rank changes; in a two-stage pipeline, where a
tensor of the last stage is on rank 1 alone, when one rank does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

STEPS = 4
GROWS_AT = 3
"""The model gets a new tensor after this step: the save of step 4 has another structure."""


def _saves_across_a_run(rank: int, world_size: int, root: str, async_save: bool) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.format import layout
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    seen: list[dict[str, Any]] = []

    class SaveEveryStep(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            step = trainer.global_step
            trainer.save_checkpoint(f"{root}/global_step_{step}")
            writer = trainer.strategy._writer
            writer.finalize(blocking=True)
            background = writer._async_queue
            seen.append(
                {
                    "step": step,
                    "pools": writer.shards.pools_started,
                    "threads": None if background is None else background.threads_started,
                    "allocations": writer.shards.staging.allocations,
                    "staged_bytes": writer.shards.staging.nbytes,
                    "planned_fresh": writer.plans.planned_fresh,
                }
            )
            if step == GROWS_AT:
                # A tensor appears in the model's state (e.g. a buffer a callback registers).
                module.gpt.register_buffer("added_after_step_3", torch.full((4, 8), 3.0))

    strategy = MegatronStrategy(ckpt_async_save=async_save)
    trainer = make_trainer(STEPS, strategy, world_size, callbacks=[SaveEveryStep()])
    module = TinyGPTModule()
    trainer.fit(module, train_dataloaders=loader(32, 2))
    steps = [s.path.name for s in layout.complete_steps(Path(root))]
    return {"seen": seen, "committed": steps}


def _saved_tensor(
    rank: int, world_size: int, model_dir: str, name: str = "added_after"
) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    keys = set(dist_checkpointing.load_tensors_metadata(model_dir))
    return {"keys": sorted(k for k in keys if name in k)}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_one_writer_reused_buffers_and_plans_follow_the_structure(
    tmp_path: Path, async_save: bool
) -> None:
    results = run_distributed(_saves_across_a_run, 2, str(tmp_path), async_save, timeout=240)
    for rank, out in enumerate(results):
        seen = out["seen"]
        assert out["committed"] == [f"global_step_{s}" for s in range(1, STEPS + 1)], out
        # One thread pool (and one background thread) for the whole run, on every rank.
        assert {s["pools"] for s in seen} == {1}, (rank, seen)
        if async_save:
            assert {s["threads"] for s in seen} == {1}, (rank, seen)
            # Buffers allocated at the first save only.
            before = [s["allocations"] for s in seen if s["step"] <= GROWS_AT]
            assert before[0] > 0 and set(before) == {before[0]}, (rank, seen)
        else:
            # A sync save of CPU tensors stages nothing: it writes the tensors themselves.
            assert {s["allocations"] for s in seen} == {0}, (rank, seen)
        # Planned from scratch at the first save and after the structure changed, only.
        assert [s["planned_fresh"] for s in seen] == [1, 1, 1, 2], (rank, seen)
    if async_save:
        # The added tensor gets a buffer on the rank that writes it (one replica is written).
        grown = [out["seen"][-1]["allocations"] - out["seen"][0]["allocations"] for out in results]
        assert sum(grown) == 1, results
    # The save after the change holds the new tensor (a stale plan would have left it out).
    (before,) = run_distributed(
        _saved_tensor, 1, str(tmp_path / f"global_step_{GROWS_AT}/model"), timeout=60
    )
    (after,) = run_distributed(
        _saved_tensor, 1, str(tmp_path / f"global_step_{STEPS}/model"), timeout=60
    )
    assert before["keys"] == [] and len(after["keys"]) == 1, (before, after)


def _local_tensors(trainer: Any) -> dict[str, torch.Tensor]:
    """This rank's shards of the model's sharded state dict, by key and offset (copies)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {
        f"{sh.key}@{sh.global_offset}": sh.data.detach().clone()
        for sh in nested_values(trainer.strategy.model_sharded_state_dict())
        if isinstance(sh, ShardedTensor)
    }


def _one_rank_grows(rank: int, world_size: int, root: str, async_save: bool) -> dict[str, Any]:
    """PP=2: after step 3 a tensor appears on rank 1 (the last stage) alone; every step is
    saved. Then a fresh model (the tensor registered, zeros; other weights from another seed)
    loads the last step, in the same processes."""
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    planned: list[int] = []
    saved: dict[str, torch.Tensor] = {}

    def added(value: float) -> torch.Tensor:
        return torch.arange(32, dtype=torch.float32).reshape(4, 8) + value

    class SaveEveryStep(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            step = trainer.global_step
            trainer.save_checkpoint(f"{root}/global_step_{step}")
            writer = trainer.strategy._writer
            writer.finalize(blocking=True)
            planned.append(writer.plans.planned_fresh)
            if step == STEPS:
                saved.update(_local_tensors(trainer))
            if step == GROWS_AT and rank == 1:
                # State that only this stage has (e.g. a buffer a callback registers there).
                module.gpt.register_buffer("added_on_rank_1", added(step))

    def strategy() -> Any:
        return MegatronStrategy(pipeline_model_parallel_size=2, ckpt_async_save=async_save)

    torch.manual_seed(0)
    trainer = make_trainer(STEPS, strategy(), world_size, callbacks=[SaveEveryStep()])
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(32, 2))

    class WithTheTensor(TinyGPTModule):  # type: ignore[misc]
        def configure_model(self) -> None:
            super().configure_model()
            if rank == 1:
                self.gpt.register_buffer("added_on_rank_1", torch.zeros(4, 8))

    torch.manual_seed(1)
    fresh = make_trainer(STEPS, strategy(), world_size)  # loads, then has no step to train
    step = f"{root}/global_step_{STEPS}"
    fresh.fit(WithTheTensor(), train_dataloaders=loader(32, 2), ckpt_path=step)
    return {"planned_fresh": planned, "saved": saved, "loaded": _local_tensors(fresh)}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_structure_change_on_one_rank_only_replans_every_rank_and_saves_it_whole(
    tmp_path: Path, async_save: bool
) -> None:
    results = run_distributed(_one_rank_grows, 2, str(tmp_path), async_save, timeout=300)
    for rank, out in enumerate(results):
        # Every rank planned afresh after the change, also rank 0, whose own state is the same.
        assert out["planned_fresh"] == [1, 1, 1, 2], (rank, out["planned_fresh"])
        # The step saved after the change loads bit-exactly into a fresh model: every tensor of
        # this rank, the new one included on rank 1.
        assert sorted(out["loaded"]) == sorted(out["saved"]), rank
        for key, tensor in out["saved"].items():
            assert torch.equal(out["loaded"][key], tensor), (rank, key)
    assert any("added_on_rank_1" in k for k in results[1]["saved"])
    assert not any("added_on_rank_1" in k for k in results[0]["saved"])
    # The index holds it once (a stale plan of rank 0's would have left it out).
    model_dir = str(tmp_path / f"global_step_{STEPS}/model")
    (after,) = run_distributed(_saved_tensor, 1, model_dir, "added_on_rank_1", timeout=60)
    assert len(after["keys"]) == 1, after


FAILS_AT = 2


def _failure_in_the_middle(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import errno

    import lightning.pytorch as pl
    from _trainer import loader, make_trainer
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from lightning_mcore_ckpt import MegatronStrategy, SaveOptions
    from lightning_mcore_ckpt.format import layout
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    stock = filesystem_async._write_item
    if rank == 1:  # this rank's disk fails while the background thread writes step 2 only

        def flaky(transforms: Any, stream: Any, *args: Any, **kwargs: Any) -> Any:
            if f"global_step_{FAILS_AT}" in str(getattr(stream, "name", "")):
                raise OSError(errno.EIO, "Input/output error")
            return stock(transforms, stream, *args, **kwargs)

        filesystem_async._write_item = flaky

    errors: dict[int, str] = {}
    finalized: list[int] = []
    threads: set[int] = set()

    class SaveEveryStep(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            step = trainer.global_step
            trainer.save_checkpoint(
                f"{root}/global_step_{step}",
                storage_options=SaveOptions(
                    on_error=lambda err, step=step: errors.__setitem__(step, str(err)),
                    on_finalized=[lambda record, step=step: finalized.append(step)],
                ),
            )
            threads.add(trainer.strategy._writer._async_queue.threads_started)

    strategy = MegatronStrategy(ckpt_async_save=True)
    trainer = make_trainer(STEPS, strategy, world_size, callbacks=[SaveEveryStep()])
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(32, 2))
    steps = sorted(s.path.name for s in layout.complete_steps(Path(root)))
    from lightning_mcore_ckpt.format import integrity

    return {
        "errors": errors,
        "finalized": finalized,
        "committed": steps,
        "threads": threads,
        "digests_left": integrity.take(f"{root}/global_step_{FAILS_AT}"),
    }


def test_a_failed_background_write_is_reported_at_its_save_and_the_writer_goes_on(
    tmp_path: Path,
) -> None:
    results = run_distributed(_failure_in_the_middle, 2, str(tmp_path), timeout=240)
    for out in results:
        # Every rank learns of the failure, at that save, with the failing rank's cause.
        assert list(out["errors"]) == [FAILS_AT], out
        message = out["errors"][FAILS_AT]
        assert f"global_step_{FAILS_AT}" in message, message
        assert "Input/output error" in message, message
        assert out["finalized"] == [s for s in range(1, STEPS + 1) if s != FAILS_AT], out
        assert out["committed"] == [
            f"global_step_{s}" for s in range(1, STEPS + 1) if s != FAILS_AT
        ], out
        assert out["threads"] == {1}, out
        assert out["digests_left"] == {}, out  # the failed save's digests were dropped
    # Nothing of the failed step is marked complete.
    assert not (tmp_path / f"global_step_{FAILS_AT}" / "metadata.json").exists()

"""The fast tier on one node (every rank sees the same directory).

- With ``replicas=0`` it keeps the node's own copy: the CPU twin of the GPU test resumes the
  newest fast step exactly, with Megatron-Core's distributed optimizer (the multi-node tests
  use torch's AdamW). On 2 ranks it does so across the optimizer (torch AdamW; the distributed
  optimizer, its persistent tier ``dp_reshardable`` and ``fully_reshardable``; a mixture of
  experts at EP=2, a chained distributed optimizer) x the precision (fp32; Megatron's bf16,
  fp32 main parameters: not with AdamW, which Megatron's bf16 does not drive): every value of
  each, every valid pair.
- With ``replicas=1`` there is no other node to hold a copy: refused at setup on every rank,
  naming the argument, the value and the fix, before anything is written.
- A ``dir`` that differs per rank (here, the rank in the path) would make each rank a node of
  its own, and its copies land on the same host: the ranks of one host must see one directory,
  refused at setup on every rank, naming the ranks, the host, their directories and the fix.
- A fast step resumes only the layout that saved it: resumed in another, it is passed over
  (the reason recorded) for the persistent tier, which reshards.
- A fast step written in rank-state format 1 (before the file named the optimizer's sharding)
  resumes exactly in the sharding of the run that saved it.
- A fast step saved by a run with another optimizer is refused on every rank before a step,
  naming the file, what it lacks and the ways on; its files stay as they were.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from _fast_tier import resumes_exactly

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(600)


def test_the_node_own_copy_resumes_exactly(tmp_path: Path) -> None:
    resumes_exactly(tmp_path, "distributed", "32", "cpu")


OPTIMIZERS = ("adamw", "distributed", "distributed_full", "moe")
PRECISIONS = ("32", "megatron-bf16")
CELLS = [
    (optimizer, precision)
    for optimizer in OPTIMIZERS
    for precision in PRECISIONS
    if not (optimizer == "adamw" and precision == "megatron-bf16")
]


@pytest.mark.parametrize(("optimizer", "precision"), CELLS)
def test_two_ranks_resume_their_own_copies_exactly(
    tmp_path: Path, optimizer: str, precision: str
) -> None:
    resumes_exactly(tmp_path, optimizer, precision, "cpu", world_size=2)


def test_a_fast_step_of_format_1_resumes_in_the_sharding_its_run_saved(tmp_path: Path) -> None:
    """A rank-state file of format 1 holds the distributed optimizer's state as the run's
    persistent tier saves it (here ``fully_reshardable``) and does not say so: it is loaded
    that way, not in the form format 2 holds."""
    resumes_exactly(tmp_path, "distributed_full", "32", "cpu", saved_format=1)


def _refused(rank: int, world_size: int, tmp: str, fast: str = "fast") -> dict[str, Any]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.errors import ConfigurationError
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    checkpoint = MegatronCheckpoint(
        f"{tmp}/ckpt",
        every_n_train_steps=2,
        fast_tier=FastTier(f"{tmp}/{fast.format(rank=rank)}", replicas=1),
    )
    trainer = make_trainer(
        4, MegatronStrategy(), world_size, callbacks=[checkpoint], enable_checkpointing=True
    )
    try:
        trainer.fit(TinyGPTModule(), train_dataloaders=loader(32))
    except ConfigurationError as err:
        return {"error": str(err), "step": trainer.global_step}
    return {"error": None}


def test_copies_on_other_nodes_are_refused_on_one_node(tmp_path: Path) -> None:
    results = run_distributed(_refused, 2, str(tmp_path))
    assert len({r["error"] for r in results}) == 1  # every rank, the same error
    error = results[0]["error"]
    assert error is not None and "FastTier(replicas=1)" in error and "replicas <= 0" in error
    assert all(r["step"] == 0 for r in results)
    assert not list((tmp_path / "fast").glob("fast_step_*"))
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("global_step_*"))


def test_ranks_of_one_host_that_see_different_directories_are_refused(tmp_path: Path) -> None:
    results = run_distributed(_refused, 2, str(tmp_path), "fast/rank{rank}")
    assert len({r["error"] for r in results}) == 1  # every rank, the same error
    error = results[0]["error"]
    assert error is not None, "two ranks of one host, each its own 'node', were taken"
    assert error.startswith("FastTier(dir=...): "), error  # a path per rank: listed below
    host = socket.gethostname()
    assert f"ranks 0, 1 run on host {host!r} but see 2 different directories" in error, error
    for rank in (0, 1):
        assert f"rank {rank}: {str(tmp_path / 'fast' / f'rank{rank}')!r}" in error, error
    assert "Give every rank of a host the same directory" in error
    assert all(r["step"] == 0 for r in results)
    assert not list((tmp_path / "fast").glob("*/fast_step_*"))
    assert not list((tmp_path / "ckpt").glob("global_step_*"))


def _layout_run(rank: int, world_size: int, tmp: str, tp: int, ckpt_path: str | None) -> int:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    checkpoint = MegatronCheckpoint(
        f"{tmp}/ckpt",
        every_n_train_steps=4,
        save_last=False,
        restore_dataloader=False,  # the data-parallel size changes with the layout
        fast_tier=FastTier(f"{tmp}/fast", every_n_train_steps=1, replicas=0),
    )
    resumed = []

    class Resumed(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            resumed.append(trainer.global_step)

    trainer = make_trainer(
        6,
        MegatronStrategy(tensor_model_parallel_size=tp),
        world_size,
        callbacks=[checkpoint, Resumed()],
        enable_checkpointing=True,
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(64), ckpt_path=ckpt_path)
    return resumed[0]


def test_a_fast_step_of_another_layout_is_passed_over_for_the_persistent_tier(
    tmp_path: Path,
) -> None:
    """Saved with DP 2 (fast step 5, persistent step 4), resumed with TP 2: the fast step is
    skipped, saying why, and the persistent step is resharded into the new layout."""
    run_distributed(_layout_run, 2, str(tmp_path), 1, None)
    assert files.is_complete(files.step_dir(tmp_path / "fast", 5))
    resumed = run_distributed(_layout_run, 2, str(tmp_path), 2, "last")
    assert resumed == [4, 4]
    records = (tmp_path / "ckpt" / "fast_tier.jsonl").read_text().splitlines()
    recovery = [r for r in map(json.loads, records) if r["kind"] == "recovery"][-1]
    assert recovery["tier"] == "persistent" and recovery["persistent_step"] == 4
    assert any(
        why.startswith("fast step 5: saved in another world size or parallel layout")
        for why in recovery["skipped"]
    ), recovery


def _first_start(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    checkpoint = MegatronCheckpoint(
        f"{tmp}/ckpt", every_n_train_steps=2, fast_tier=FastTier(f"{tmp}/fast", replicas=0)
    )
    trainer = make_trainer(
        3, MegatronStrategy(), world_size, callbacks=[checkpoint], enable_checkpointing=True
    )
    module = TinyGPTModule()
    trainer.fit(module, train_dataloaders=loader(32), ckpt_path="last")
    return {"step": trainer.global_step, "losses": len(module.step_losses)}


def test_the_first_start_with_last_and_a_fast_tier_trains_from_scratch(tmp_path: Path) -> None:
    # One command line for every (re)start: with neither tier holding a step, "last" starts
    # from scratch (every rank asked the fast tier together, and found nothing).
    results = run_distributed(_first_start, 2, str(tmp_path))
    assert results == [{"step": 3, "losses": 3}] * 2


def _optimizer_run(
    rank: int, world_size: int, tmp: str, optimizer: str, ckpt_path: str | None
) -> Any:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    checkpoint = MegatronCheckpoint(
        f"{tmp}/ckpt",
        every_n_train_steps=1000,
        save_last=False,
        fast_tier=FastTier(f"{tmp}/fast", every_n_train_steps=1, replicas=0),
    )
    steps: list[int] = []

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            steps.append(trainer.global_step)

    trainer = make_trainer(
        3,
        MegatronStrategy(),
        world_size,
        callbacks=[checkpoint, Steps()],
        enable_checkpointing=True,
    )
    try:
        trainer.fit(
            TinyGPTModule(optimizer=optimizer), train_dataloaders=loader(32), ckpt_path=ckpt_path
        )
    except ValueError as err:
        return {"error": str(err), "steps": steps}
    return {"error": None, "steps": steps}


def test_a_fast_step_of_another_optimizer_is_refused_naming_the_ways_on(tmp_path: Path) -> None:
    """Fast steps saved with torch AdamW, resumed by a run with Megatron-Core's distributed
    optimizer: each rank's file lacks the state that run loads. Refused on every rank before a
    step, naming the file, what it lacks and the ways on (the persistent tier, or the fast
    tier's steps moved away); the files stay as they were."""
    first = run_distributed(_optimizer_run, 2, str(tmp_path), "adamw", None)
    assert all(r["error"] is None for r in first), first
    step = files.step_dir(tmp_path / "fast", 2)
    assert files.is_complete(step)
    before = {p: p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()}
    results = run_distributed(_optimizer_run, 2, str(tmp_path), "distributed", "last")
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, (rank, result)
        assert error.startswith(f"{step / f'state_{rank:05d}.pt'}: the rank state has no "), error
        assert "saved by a run with another model or optimizer" in error, error
        assert "fit(ckpt_path=<its global_step_N directory>)" in error, error
        assert f"move the fast tier's steps out of {tmp_path / 'fast'}" in error, error
        assert result["steps"] == [], (rank, result)
    assert {p: p.read_bytes() for p in sorted(step.rglob("*")) if p.is_file()} == before

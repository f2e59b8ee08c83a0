"""The first save planned ahead: after the first optimizer step, ``MegatronCheckpoint`` has the
strategy plan the first save (``MegatronStrategy.plan_saves_ahead``), so that the first save
runs as many collectives as the later ones, writes the same step, and nothing else is written.

Axes, on 2 gloo ranks with data parallelism (Megatron-Core's fully parallel save, whose
assignment of replicated tensors is planned and kept too):
- mode: sync, async;
- writer: ours (threads), Megatron-Core's;
- gradient accumulation: 1, 2 batches (the first optimizer step comes after the second batch);
- staging (our writer's): unbounded, bounded (``ckpt_max_staging_bytes``);
every pair of those in six cells (Megatron-Core's writer stages with its own). Then, each on its own: the structure changed between the
planning and the first save (a tensor added: the first save plans afresh and holds it), plans
not kept (``ckpt_cache_plans=False``: nothing is planned ahead), and planning that fails on every
rank (the run goes on; the first save plans itself).

Each cell asserts, on every rank: the collectives each save ran (the first as many as the
last, unless its plan could not be used), whether it planned ahead, the steps committed, the
first step's weights bit-exactly those of the model when it was saved, that the planning's
scratch directories are gone, and, for our writer, that the first save staged into memory
allocated ahead (no staging allocated at any save; on CPU an async save's snapshot is what is
staged, on a GPU every save's device-to-host copy).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

EVERY = 2
SAVES = 3
_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "broadcast_object_list",
    "all_gather",
    "all_reduce",
    "broadcast",
    "barrier",
)


def _count_collectives(counts: dict[str, int]) -> None:
    """Count every call of torch.distributed's collectives (as Megatron-Core and torch DCP
    call them: ``torch.distributed.<name>``) into ``counts``: ``"n"``, or ``"finalising"`` for
    those of Megatron-Core's finalisers run by our writer (under ``_metadata_ahead.agreed``)."""
    import contextlib

    import torch.distributed as dist

    from lightning_mcore_ckpt.engine import _metadata_ahead

    inside = {"finalisers": False}

    for name in _COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counts["finalising" if inside["finalisers"] else "n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)

    agreed = _metadata_ahead.agreed

    @contextlib.contextmanager
    def finalisers(everywhere: bool) -> Any:
        inside["finalisers"] = True
        try:
            with agreed(everywhere):
                yield
        finally:
            inside["finalisers"] = False

    _metadata_ahead.agreed = finalisers


def _run(
    rank: int,
    world_size: int,
    root: str,
    async_save: bool,
    writer: str,
    accumulate: int,
    case: str,
    bounded: bool = False,
) -> dict[str, Any]:
    import shutil
    import tempfile

    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.engine import _writer
    from lightning_mcore_ckpt.format import layout
    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    # Where the planning's scratch directories go: a short path of this rank's own (Megatron-Core's
    # writer on CPU puts a manager's socket there too, and a socket's path is short).
    scratch = Path(tempfile.mkdtemp(prefix=f"lmc-pa{rank}-"))
    tempfile.tempdir = str(scratch)
    counts = {"n": 0, "finalising": 0}
    _count_collectives(counts)
    per_save: list[int] = []  # the save call's collectives (planning; a sync save's write)
    finalising: list[int] = []  # the finalisation's (a sync save's inside it, an async's after)
    first_weights: dict[str, torch.Tensor] = {}

    strategy = MegatronStrategy(
        ckpt_async_save=async_save,
        ckpt_writer=writer,
        ckpt_cache_plans=case != "no-cache",
        ckpt_max_staging_bytes=64 * 1024 if bounded else None,
    )
    writer_obj = strategy._writer
    save = writer_obj.save
    shards = writer_obj.shards
    staging = shards.staging if shards.bounded is None else shards.bounded
    allocated: list[int] = []  # staging allocated by each save

    def counted_save(*args: Any, **kwargs: Any) -> Any:
        writer_obj.finalize(blocking=True)  # the previous save's finalising is not this one's
        before, finalisers = counts["n"], counts["finalising"]
        allocations = staging.allocations
        out = save(*args, **kwargs)
        allocated.append(staging.allocations - allocations)
        planned = counts["n"]
        writer_obj.finalize(blocking=True)
        per_save.append(planned - before)
        finalising.append(counts["n"] - planned + counts["finalising"] - finalisers)
        if len(per_save) == 1:
            first_weights.update(gather_sharded(strategy.model_sharded_state_dict()))
        return out

    writer_obj.save = counted_save  # type: ignore[method-assign]
    if case == "fails":
        plan = _writer.plan_requests

        def failing(parts: Any, *args: Any, **kwargs: Any) -> Any:
            if "lmc-plan-ahead-" in str(parts[0][1]):
                raise RuntimeError("planning refused (injected)")
            return plan(parts, *args, **kwargs)

        _writer.plan_requests = failing

    class Grow(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            # After the planning (first optimizer step), before the first save: a tensor
            # appears in the model's state (e.g. a buffer a callback registers).
            if case == "grows" and trainer.global_step == 1:
                if not hasattr(module.gpt, "added_after_planning"):
                    module.gpt.register_buffer("added_after_planning", torch.full((4, 8), 1.0))

    callback = MegatronCheckpoint(
        Path(root, "ckpt"), every_n_train_steps=EVERY, save_last=False, save_top_k=-1
    )
    trainer = make_trainer(
        SAVES * EVERY,
        strategy,
        world_size,
        callbacks=[Grow(), callback],
        accumulate_grad_batches=accumulate,
        enable_checkpointing=True,
    )
    torch.manual_seed(0)
    try:
        trainer.fit(TinyGPTModule(), train_dataloaders=loader(64, 2))
        left = sorted(p.name for p in scratch.glob("lmc-plan-ahead-*"))
    finally:
        tempfile.tempdir = None
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "per_save": per_save,
        "finalising": finalising,
        "planned_ahead_s": writer_obj.planned_ahead_s,
        "planned_fresh": writer_obj.plans.planned_fresh,
        "committed": [s.path.name for s in layout.complete_steps(Path(root, "ckpt"))],
        "scratch_left": left,
        "first_weights": first_weights,
        "allocated": allocated,
        "staging_allocations": staging.allocations,
    }


def _saved_weights(rank: int, world_size: int, step_dir: str, grown: bool) -> dict[str, Any]:
    """The model's weights in ``step_dir``, loaded by a fresh model through the strategy."""
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    class WithTheBuffer(TinyGPTModule):  # type: ignore[misc]
        def configure_model(self) -> None:
            super().configure_model()
            if grown:
                self.gpt.register_buffer("added_after_planning", torch.zeros(4, 8))

    torch.manual_seed(7)
    trainer = make_trainer(EVERY, MegatronStrategy(), world_size)  # loads, has nothing to train
    trainer.fit(WithTheBuffer(), train_dataloaders=loader(64, 2), ckpt_path=step_dir)
    return gather_sharded(trainer.strategy.model_sharded_state_dict())


def _check(
    tmp_path: Path,
    results: list[dict[str, Any]],
    case: str,
    threads: bool = False,
    staged: bool = False,
) -> None:
    steps = [f"global_step_{EVERY * (i + 1)}" for i in range(SAVES)]
    for rank, out in enumerate(results):
        assert out["committed"] == steps, (rank, out["committed"])
        assert out["scratch_left"] == [], (rank, out["scratch_left"])
        per_save = out["per_save"]
        assert len(per_save) == SAVES, (rank, per_save)
        if case == "no-cache":
            assert out["planned_ahead_s"] is None, rank
            continue
        if case == "fails":
            assert out["planned_ahead_s"] == 0.0, rank
        else:
            assert out["planned_ahead_s"] > 0.0, rank
        if case == "planned":
            # The first save ran the collectives of the later ones: no plan gathered, checked
            # or assigned afresh. Planned afresh once, ahead.
            assert per_save[0] == per_save[-1], (rank, per_save)
            assert out["planned_fresh"] == 1, (rank, out["planned_fresh"])
            # Its finalisation too, but for our writer: the later ones skip the gather of the
            # write results that the first needs (nothing kept yet to write .metadata ahead
            # from: tests/distributed/test_metadata_ahead.py).
            first, last = out["finalising"][0], out["finalising"][-1]
            assert first == last or (threads and first > last), (rank, out["finalising"])
            # No save allocated staging: the first staged into memory allocated ahead.
            assert out["allocated"] == [0] * SAVES, (rank, out["allocated"])
            if staged:  # (and there was staging to allocate)
                assert out["staging_allocations"] > 0, rank
        else:
            # Its plan could not be used (the structure changed, or the planning failed):
            # the first save planned itself.
            assert per_save[0] > per_save[-1], (rank, per_save)
    # The first step holds the weights the model had when it was saved, bit for bit (and the
    # tensor added after the planning).
    step_dir = str(tmp_path / "ckpt" / steps[0])
    loaded = run_distributed(_saved_weights, 2, step_dir, case == "grows", timeout=120)
    for rank, out in enumerate(results):
        expected = out["first_weights"]
        assert sorted(loaded[rank]) == sorted(expected), rank
        for key, tensor in expected.items():
            assert torch.equal(loaded[rank][key], tensor), (rank, key)
    if case == "grows":
        assert any("added_after_planning" in key for key in results[0]["first_weights"])


@pytest.mark.parametrize(
    ("async_save", "writer", "accumulate", "bounded"),
    [
        (False, "threads", 1, False),
        (True, "threads", 2, False),
        (False, "threads", 2, True),
        (True, "threads", 1, True),
        (False, "megatron", 2, False),
        (True, "megatron", 1, False),
    ],
    ids=[
        "sync-threads-acc1",
        "async-threads-acc2",
        "sync-threads-acc2-bounded",
        "async-threads-acc1-bounded",
        "sync-megatron-acc2",
        "async-megatron-acc1",
    ],
)
def test_the_first_save_runs_the_collectives_of_the_later_ones(
    tmp_path: Path, async_save: bool, writer: str, accumulate: int, bounded: bool
) -> None:
    results = run_distributed(
        _run, 2, str(tmp_path), async_save, writer, accumulate, "planned", bounded, timeout=240
    )
    # On CPU, our writer stages an async save's snapshot (a sync save writes the tensors).
    _check(tmp_path, results, "planned", writer == "threads", async_save and writer == "threads")


@pytest.mark.parametrize("case", ["grows", "no-cache", "fails"])
def test_a_plan_that_cannot_be_used_leaves_the_first_save_to_plan_itself(
    tmp_path: Path, case: str
) -> None:
    results = run_distributed(_run, 2, str(tmp_path), True, "threads", 1, case, timeout=240)
    _check(tmp_path, results, case)

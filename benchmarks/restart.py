"""Restart time, the figure users feel: launch -> first resumed step done.

Each launch is a fresh rank process started by ``run_distributed`` (forked from its server,
which has imported torch, Lightning and Megatron-Core, the same for every row: interpreter
start and those imports are not in the figure; a CUDA context is). The launcher passes
``time.time()`` taken just before it starts the rank; a callback takes the time at the end of
the run's first training step (``on_train_batch_end``), and at the phases on the way:

- rank started (the function entered); Trainer built; model set up (``on_fit_start``: the
  process group, the model built, moved to its device, its optimizer); training started
  (``on_train_start``: on a resume, after the checkpoint is loaded); first step done.

Three rows of the same model and state (the data from a ``StatefulDataLoader``, whose position
both resumes restore), the page cache dropped before each launch:

- **fresh start**: no checkpoint;
- **ours, resumed**: ``MegatronStrategy`` + ``MegatronCheckpoint``, ``fit(ckpt_path="last")``;
- **Lightning default, resumed**: Lightning's own checkpointing of the same model (its
  ``ModelCheckpoint`` writing ``torch.save`` files through ``TorchCheckpointIO``, and its resume:
  ``torch.load`` onto the host, then the module's and the optimizer's ``load_state_dict``),
  ``fit(ckpt_path=<that file>)``. The Megatron-Core model still needs Megatron's parallel state,
  so the strategy is ``MegatronStrategy`` with every checkpoint method handed back to
  Lightning's ``Strategy`` (one process: Lightning's default saves on global rank 0 only).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import workloads

__all__ = ["ROWS", "launch", "restart_times"]

# Steps trained before the checkpoint that a resume starts from.
STEPS = 2

ROWS = ("fresh start", "ours, resumed", "Lightning default, resumed")
PHASES = ("rank started", "Trainer built", "model set up", "training started", "first step done")


def _lightning_default_strategy() -> Any:
    from lightning.pytorch.strategies import Strategy

    from lightning_mcore_ckpt import MegatronStrategy

    class LightningDefault(MegatronStrategy):  # type: ignore[misc]
        """Megatron-Core's parallel state and model, with Lightning's default checkpointing:
        every checkpoint method is ``Strategy``'s (``torch.save`` / ``torch.load`` through
        ``TorchCheckpointIO``, full state dicts, the optimizer restored by Lightning)."""

        @property
        def lightning_restore_optimizer(self) -> bool:
            return True

        def lightning_module_state_dict(self) -> dict[str, Any]:
            return Strategy.lightning_module_state_dict(self)

        def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
            return Strategy.optimizer_state(self, optimizer)

        def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
            Strategy.load_model_state_dict(self, checkpoint, strict=strict)

        def load_optimizer_state_dict(self, checkpoint: Any) -> None:
            Strategy.load_optimizer_state_dict(self, checkpoint)

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
        ) -> None:
            Strategy.save_checkpoint(self, checkpoint, filepath, storage_options)

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
            return Strategy.load_checkpoint(self, checkpoint_path, weights_only)

        def remove_checkpoint(self, filepath: Any) -> None:
            Strategy.remove_checkpoint(self, filepath)

    return LightningDefault()


def launch(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One launch: ``cfg["kind"]`` is ``"ours"`` or ``"lightning"``; ``cfg["mode"]`` is
    ``"prepare"`` (train ``STEPS`` steps, save at the last), ``"fresh"`` (no checkpoint) or
    ``"resume"``; a fresh or resumed run stops after its first step. Returns seconds since
    ``cfg["launched_at"]`` at each phase, the global step of the first step, and where the
    state was then."""
    started = time.time()
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy

    launched_at = cfg.get("launched_at", started)
    marks: dict[str, float] = {"rank started": started - launched_at}
    seen: dict[str, Any] = {}

    class Clock(pl.Callback):  # type: ignore[misc]
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            marks["model set up"] = time.time() - launched_at

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            marks["training started"] = time.time() - launched_at

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if "first step done" in marks:
                return
            if trainer.strategy.root_device.type == "cuda":
                import torch

                torch.cuda.synchronize()
            marks["first step done"] = time.time() - launched_at
            state = workloads.state_tensors(pl_module, trainer.strategy._torch_optimizers())
            seen.update(
                step=trainer.global_step,
                device=workloads.device_of(state),
                in_fit=workloads.in_fit(trainer),
            )

    root, mode, kind = Path(cfg["dir"]), cfg["mode"], cfg["kind"]
    device = cfg.get("device", "cpu")
    if kind == "ours":
        strategy: Any = MegatronStrategy()
        checkpoint: Any = MegatronCheckpoint(root, every_n_train_steps=STEPS, save_last=False)
    else:
        strategy = _lightning_default_strategy()
        checkpoint = ModelCheckpoint(dirpath=root, every_n_train_steps=STEPS, save_top_k=-1)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=device,
        devices=world,
        max_steps=STEPS if mode == "prepare" else (STEPS + 1 if mode == "resume" else 1),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock(), checkpoint],
    )
    workloads.watch_teardown(trainer)
    marks["Trainer built"] = time.time() - launched_at
    ckpt_path = None
    if mode == "resume":
        ckpt_path = "last" if kind == "ours" else str(lightning_file(root))
    trainer.fit(
        workloads._module(cfg["size"]),
        train_dataloaders=workloads._loader(stateful=True),
        ckpt_path=ckpt_path,
    )
    return {"phases": marks, **seen}


def lightning_file(root: Path) -> Path:
    """The one ``.ckpt`` file Lightning's ModelCheckpoint wrote under ``root``."""
    (path,) = sorted(Path(root).glob("*.ckpt"))
    return path


def restart_times(scratch: Path, size: str, device: str, repeats: int) -> dict[str, Any]:
    """Each row launched ``repeats`` times (rows interleaved, the page cache dropped before
    every launch); medians of every phase, and the bytes each resume read."""
    from lightning_mcore_ckpt.format import layout
    from lightning_mcore_ckpt.testing import run_distributed

    base = {"size": size, "device": device}
    ours, lightning = scratch / "ours", scratch / "lightning"
    run_distributed(launch, 1, {**base, "dir": str(ours), "kind": "ours", "mode": "prepare"})
    run_distributed(
        launch, 1, {**base, "dir": str(lightning), "kind": "lightning", "mode": "prepare"}
    )
    step = layout.resolve_last(ours, verify=False)
    assert step is not None, f"no committed step in {ours}"
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
    for i in range(repeats):
        for row, kind, mode, directory in (
            (ROWS[0], "ours", "fresh", scratch / f"fresh-{i}"),
            (ROWS[1], "ours", "resume", ours),
            (ROWS[2], "lightning", "resume", lightning),
        ):
            workloads.drop_cache(ours)
            workloads.drop_cache(lightning)
            cfg: dict[str, Any] = {**base, "dir": str(directory), "kind": kind, "mode": mode}
            cfg["launched_at"] = time.time()
            runs[row].append(run_distributed(launch, 1, cfg, timeout=3600)[0])
    rows = {}
    for row, results in runs.items():
        rows[row] = {
            "launch_to_first_step_s": workloads._summary(
                [r["phases"]["first step done"] for r in results]
            ),
            "phases": {
                phase: statistics.median(r["phases"][phase] for r in results) for phase in PHASES
            },
            "step": results[-1]["step"],
            "device": results[-1]["device"],
            "in_fit": all(r["in_fit"] for r in results),
        }
    return {
        "size": size,
        "world": 1,
        "device": device,
        "steps_before": STEPS,
        "bytes": {
            "ours, resumed": workloads.tree_bytes(step),
            "Lightning default, resumed": lightning_file(lightning).stat().st_size,
        },
        "rows": rows,
    }

"""Helpers shared by the distributed Trainer tests (run inside each rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_trainer(max_steps: int, strategy: Any, devices: int, **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    options: dict[str, Any] = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=max_steps, **options
    )


def record_losses(module: Any) -> dict[int, float]:
    """Wrap ``module.training_step`` so that each step's loss is recorded: the dict it fills,
    by global step."""
    losses: dict[int, float] = {}
    original = module.training_step

    def training_step(batch: Any, batch_idx: int) -> Any:
        loss = original(batch, batch_idx)
        losses[module.trainer.global_step] = float(loss)
        return loss

    module.training_step = training_step
    return losses


def loader(num_samples: int, batch_size: int = 2, **kwargs: Any) -> Any:
    # Resumable: a plain DataLoader cannot be resumed inside an epoch (that is refused).
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt.tiny import TokenDataset

    return StatefulDataLoader(TokenDataset(num_samples), batch_size=batch_size, **kwargs)


def gathered_weights(trainer: Any) -> dict[str, torch.Tensor]:
    from lightning_mcore_ckpt.testing import gather_sharded

    return gather_sharded(trainer.strategy.model_sharded_state_dict())


def gathered_optimizer(trainer: Any) -> dict[str, torch.Tensor]:
    """The optimizer state as full tensors, whatever the layout: a Megatron distributed
    optimizer's in its fully reshardable (per-parameter) form, main parameters included."""
    from lightning_mcore_ckpt.engine import (
        megatron_optimizer_metadata,
        optimizer_sharded_state_dict,
    )
    from lightning_mcore_ckpt.testing import gather_sharded

    strategy = trainer.strategy
    return gather_sharded(
        optimizer_sharded_state_dict(
            strategy._torch_optimizers(),
            strategy.lightning_module,
            strategy.model_sharded_state_dict(),
            metadata=megatron_optimizer_metadata("fully_reshardable"),
        )
    )


def resume_and_continue(
    module: Any, strategy: Any, world_size: int, step_dir: str, max_steps: int
) -> dict[str, Any]:
    """Resume ``module`` from ``step_dir`` up to ``max_steps``: what the load restored (the
    gathered weights and optimizer state, and the step, at the start of training), the losses
    after it and the step it ended at."""
    import lightning.pytorch as pl

    seen: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen["weights"] = gathered_weights(trainer)
            seen["optim"] = gathered_optimizer(trainer)
            seen["start_step"] = trainer.global_step

    trainer = make_trainer(max_steps, strategy, world_size, callbacks=[Capture()])
    trainer.fit(module, train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=step_dir)
    seen["losses"] = module.step_losses
    seen["end_step"] = trainer.global_step
    return seen


def resave_on_this_layout_and_export(tmp: str, step: str, name: str) -> None:
    """Load ``tmp/step`` (an ``HFGPTModule`` run of ``tmp/src``) on this process group's layout,
    save its model as ``tmp/name`` and export that to ``tmp/name_hf``."""
    from lightning_mcore_ckpt import MegatronStrategy, SaveOptions, hf
    from lightning_mcore_ckpt.tiny import HFGPTModule

    src = str(Path(tmp, "src"))
    trainer = make_trainer(3, MegatronStrategy(), 1)
    trainer.validate(
        HFGPTModule(src), dataloaders=loader(4, 2), ckpt_path=str(Path(tmp, step)), verbose=False
    )
    out = Path(tmp, name)
    trainer.save_checkpoint(out, storage_options=SaveOptions(contents=["model"]))
    hf.export_checkpoint(out, src, Path(tmp, f"{name}_hf"), require_complete=False)

"""One tiny training run, the same under every version of the package (run inside each rank).

Used to write the v0.1 fixture steps (``fixtures/v0_1``, with the package at e0c820b) and to
resume them with the current package.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

MAX_STEPS = 6


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().float().cpu().numpy().tobytes()).hexdigest()
        for k, v in sorted(tensors.items())
    }


def train(
    rank: int,
    world_size: int,
    dirpath: str,
    max_steps: int,
    ckpt_path: Any,
    writer: str | None = None,
) -> dict:
    """The run; ``writer``: ``MegatronStrategy(ckpt_writer=...)`` (0.1 had Megatron-Core's only)."""
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset

    pl.seed_everything(0)
    loader = StatefulDataLoader(TokenDataset(32), batch_size=2, shuffle=True)
    module = TinyGPTModule()
    started: dict[str, int] = {}

    class Start(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            started["step"] = trainer.global_step

    trainer = pl.Trainer(
        strategy=MegatronStrategy(**({"ckpt_writer": writer} if writer else {})),
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[MegatronCheckpoint(dirpath, every_n_train_steps=2, max_to_keep=2), Start()],
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    weights = gather_sharded(trainer.strategy.model_sharded_state_dict())
    return {
        "start": started["step"],
        "losses": [float(x) for x in module.step_losses],
        "weights": digest(weights),
    }

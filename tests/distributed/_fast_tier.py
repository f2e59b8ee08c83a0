"""The fast tier on one node, one rank: a run saves fast steps only, a second resumes the newest
exactly. Shared by the GPU test (``tests/gpu/test_fast_tier_gpu.py``: staged into pinned
memory) and its CPU twin (``tests/distributed/test_fast_tier_one_node.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt.testing import run_distributed

FAST = 3
END = 6


def _job(
    rank: int,
    world_size: int,
    tmp: str,
    optimizer: str,
    precision: str,
    accelerator: str,
    ckpt_path: str | None,
) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import gathered_optimizer, gathered_weights, loader, record_losses

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    module = TinyGPTModule(optimizer=optimizer)
    losses = record_losses(module)
    seen: dict[str, Any] = {"pinned": []}
    checkpoint = MegatronCheckpoint(
        f"{tmp}/ckpt",
        every_n_train_steps=1000,
        save_last=False,
        fast_tier=FastTier(f"{tmp}/fast", every_n_train_steps=FAST, replicas=0),
    )

    class Watch(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["resumed"] = trainer.global_step

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            fast = checkpoint._fast
            if fast is not None and fast.writer.cache._buffers:
                seen["pinned"].append(
                    all(b.is_pinned() for b in fast.writer.cache._buffers.values())
                )

    trainer = pl.Trainer(
        strategy=MegatronStrategy(),
        accelerator=accelerator,
        devices=1,
        precision=precision,
        max_steps=END,
        callbacks=[checkpoint, Watch()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader(64), ckpt_path=ckpt_path)
    return {
        "losses": losses,
        "weights": gathered_weights(trainer),
        "optim": gathered_optimizer(trainer),
        **seen,
    }


def resumes_exactly(tmp: Path, optimizer: str, precision: str, accelerator: str) -> None:
    """The check, on ``accelerator`` (its CPU twin runs it with ``"cpu"``)."""
    first = run_distributed(_job, 1, str(tmp), optimizer, precision, accelerator, None)[0]
    again = run_distributed(_job, 1, str(tmp), optimizer, precision, accelerator, "last")[0]
    newest = (END - 1) // FAST * FAST
    assert again["resumed"] == newest
    assert again["losses"] == {k: v for k, v in first["losses"].items() if k >= newest}
    for name in ("weights", "optim"):
        assert again[name].keys() == first[name].keys()
        for key, tensor in again[name].items():
            assert torch.equal(tensor, first[name][key]), (name, key)
    if accelerator == "gpu":
        assert first["pinned"] and all(first["pinned"]), first["pinned"]

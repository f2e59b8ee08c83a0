"""GPU tier: the same exact-resume and resharding checks over NCCL on CUDA devices."""

from __future__ import annotations

from pathlib import Path

import torch
from _marks import TWO_GPUS

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = TWO_GPUS


def _train_save_resume(rank: int, world_size: int, tmp: str) -> dict[str, object]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset

    step_dir = str(Path(tmp) / "global_step_3")

    class SaveOnce(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == 3:
                trainer.save_checkpoint(step_dir)

    def run(ckpt: str | None, callbacks: list[pl.Callback]) -> TinyGPTModule:
        module = TinyGPTModule()
        trainer = pl.Trainer(
            strategy=MegatronStrategy(tensor_model_parallel_size=2, ckpt_async_save=True),
            accelerator="gpu",
            devices=world_size,
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            callbacks=callbacks,
        )
        assert trainer.strategy.process_group_backend == "nccl" or ckpt is None
        trainer.fit(module, DataLoader(TokenDataset(6), batch_size=2, shuffle=True), ckpt_path=ckpt)
        return module

    full = run(None, [SaveOnce()])
    resumed = run(step_dir, [])
    return {
        "full": [x.cpu() for x in full.step_losses],
        "resumed": [x.cpu() for x in resumed.step_losses],
    }


def test_nccl_tp2_async_save_resumes_bit_identically(tmp_path: Path) -> None:
    for r in run_distributed(_train_save_resume, 2, str(tmp_path), timeout=560):
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], r["full"][3:], strict=True))

"""GPU tier: a Megatron-Core ``MegatronOptimizer`` (distributed optimizer over Megatron DDP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _marks import TWO_GPUS

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = TWO_GPUS


def _train_save_resume(rank: int, world_size: int, tmp: str) -> dict[str, object]:
    import lightning.pytorch as pl
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from torch.utils.data import DataLoader

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataset

    step_dir = str(Path(tmp) / "global_step_2")

    class WithMegatronOptimizer(TinyGPTModule):  # type: ignore[misc]
        def configure_model(self) -> None:
            if self.gpt is not None:
                return
            super().configure_model()
            gpt: Any = self.gpt
            self.gpt = DistributedDataParallel(
                config=gpt.config,
                ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
                module=gpt,
            )

        def configure_optimizers(self) -> Any:
            config = OptimizerConfig(
                optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0
            )
            return get_megatron_optimizer(config, [self.gpt])

    class SaveOnce(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == 2:
                trainer.save_checkpoint(step_dir)

    def run(ckpt: str | None, callbacks: list[pl.Callback]) -> Any:
        module = WithMegatronOptimizer()
        trainer = pl.Trainer(
            strategy=MegatronStrategy(),
            accelerator="gpu",
            devices=world_size,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            callbacks=callbacks,
        )
        trainer.fit(module, DataLoader(TokenDataset(16), batch_size=2), ckpt_path=ckpt)
        return module

    full = run(None, [SaveOnce()])
    resumed = run(step_dir, [])
    return {
        "full": [x.cpu() for x in full.step_losses],
        "resumed": [x.cpu() for x in resumed.step_losses],
        "optim_files": sorted(p.name for p in (Path(step_dir) / "optim").iterdir()),
    }


def test_distributed_optimizer_saves_sharded_and_resumes_bit_identically(tmp_path: Path) -> None:
    for r in run_distributed(_train_save_resume, 2, str(tmp_path), timeout=560):
        assert r["optim_files"], "the optimizer was not written"
        assert len(r["resumed"]) == 2
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], r["full"][2:], strict=True))

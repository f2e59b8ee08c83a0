"""The LightningCLI config with a fast tier that the README shows is ``examples/fast_tier.yaml``,
and ``examples/pretrain_gpt.py``'s LightningCLI builds what it says from it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "fast_tier.yaml"


def test_the_readme_shows_the_config_file_as_it_is() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```$", readme, flags=re.S | re.M)
    assert CONFIG.read_text() in blocks, "README.md's YAML differs from examples/fast_tier.yaml"


def test_lightning_cli_builds_the_callback_with_its_fast_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningCLI

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataModule

    class FitRecorder(Trainer):
        """A Trainer whose ``fit`` records its arguments instead of training."""

        def fit(
            self,
            model: Any,
            train_dataloaders: Any = None,
            val_dataloaders: Any = None,
            datamodule: Any = None,
            ckpt_path: str | Path | None = None,
            weights_only: bool | None = None,
        ) -> None:
            self.fit_args = (model, datamodule, ckpt_path)

    monkeypatch.chdir(tmp_path)  # the config's relative paths resolve here
    # examples/pretrain_gpt.py's LightningCLI, and its command line; the config asks for GPUs,
    # so the Trainer is built for CPU processes here, every other value as written.
    cli = LightningCLI(
        trainer_class=FitRecorder,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=["fit", "--config", str(CONFIG), "--trainer.accelerator", "cpu"],
    )
    trainer = cli.trainer
    assert isinstance(trainer, FitRecorder)
    model, datamodule, ckpt_path = trainer.fit_args
    assert isinstance(model, TinyGPTModule) and isinstance(datamodule, TokenDataModule)
    assert ckpt_path == "last"
    assert (trainer.num_nodes, trainer.num_devices) == (2, 8)
    assert isinstance(trainer.strategy, MegatronStrategy)
    assert trainer.strategy.tensor_model_parallel_size == 2 and trainer.strategy.ckpt_async_save
    checkpoint = trainer.checkpoint_callback
    assert isinstance(checkpoint, MegatronCheckpoint)
    assert checkpoint.config.every_n_train_steps == 500 and checkpoint.config.max_to_keep == 3
    assert checkpoint.config.fast_tier == FastTier(
        "/local_nvme/pretrain", every_n_train_steps=20, replicas=1, max_to_keep=2
    )
    assert list(tmp_path.iterdir()) == []  # building the job wrote nothing

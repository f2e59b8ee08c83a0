"""Pretrain a tiny Megatron-Core GPT with Lightning, configured entirely in YAML.

    python examples/pretrain_gpt.py fit --config examples/config.yaml
    python examples/pretrain_gpt.py fit --config examples/config.yaml --trainer.max_steps 4

Tensor parallelism 2 on 2 processes: CPU processes here, GPUs when you set
``trainer.accelerator: gpu``. A checkpoint every few steps (``MegatronCheckpoint``), and the
config's ``ckpt_path: last`` makes the same command resume exactly after a crash or a
preemption, or start from scratch when there is nothing to resume.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lightning_mcore_ckpt.tiny import TinyGPTModule, TokenDataModule


def main() -> None:
    LightningCLI(TinyGPTModule, TokenDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()

"""Pretrain a tiny Megatron-Core GPT with Lightning, configured entirely in YAML.

    python examples/pretrain_gpt.py fit --config examples/config.yaml
    python examples/pretrain_gpt.py fit --config examples/config.yaml --trainer.max_steps 4

Tensor parallelism 2 on 2 processes: CPU processes here, GPUs when you set
``trainer.accelerator: gpu``. The model and the data are named in the config by
``class_path``, so the same script trains your own classes. A checkpoint every few steps
(``MegatronCheckpoint``), and the config's ``ckpt_path: last`` makes the same command resume
exactly after a crash or a preemption, or start from scratch when there is nothing to resume.
``lightning-mcore-ckpt check-resume --config examples/config.yaml --stop-at 3`` proves it.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI


def main() -> None:
    # The config names the model and the data by class_path (LightningCLI's subclass mode).
    LightningCLI(
        subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    main()

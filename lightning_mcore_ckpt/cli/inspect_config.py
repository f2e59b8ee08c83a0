"""The model a LightningCLI config builds, for ``lightning-mcore-ckpt inspect --config``:
its checkpoint keys and global shapes, built on the meta device (no weights) on one process,
and the layout the config trains with."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_mcore_ckpt.cli.inspect import SIZES, ModelSpec

__all__ = ["spec_from_config"]


def spec_from_config(config: str | os.PathLike[str]) -> tuple[ModelSpec, dict[str, int]]:
    """The model a LightningCLI config builds (on the meta device, with TP=PP=1 on this one
    process: checkpoint keys and global shapes do not depend on the layout) and the layout the
    config trains with (its ``MegatronStrategy`` sizes, and ``trainer.devices`` x
    ``num_nodes`` for the data-parallel size)."""
    import torch
    import yaml
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.transformer.module import MegatronModule

    from lightning_mcore_ckpt.engine import module_sharded_state_dict
    from lightning_mcore_ckpt.hf._import import (
        megatron_environ_writes_undone,
        single_process_parallel_state,
    )

    data = yaml.safe_load(Path(config).read_text())
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"--config {config}: not a LightningCLI config with a 'model'")
    trainer = data.get("trainer") or {}
    strategy = trainer.get("strategy") or {}
    sizes = dict(strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    target = {k: int(v) for k, v in sizes.items() if k in SIZES}
    devices = trainer.get("devices", 1)
    devices = len(devices) if isinstance(devices, list) else devices
    if isinstance(devices, int) and not isinstance(devices, bool):
        world = devices * int(trainer.get("num_nodes", 1) or 1)
        model_parallel = 1
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            model_parallel *= target.get(name, 1)
        model_parallel *= target.get("context_parallel_size", 1)
        target["data_parallel_size"] = max(1, world // model_parallel)
    # The model, attached to a one-process CPU Trainer with the config's strategy options
    # (modules read them in configure_model) but TP=PP=CP=EP=1.
    import lightning.pytorch as pl
    from lightning.pytorch.cli import instantiate_class

    from lightning_mcore_ckpt.strategy import MegatronStrategy

    options = {k: v for k, v in sizes.items() if k not in SIZES and k != "sequence_parallel"}
    with single_process_parallel_state(), megatron_environ_writes_undone():
        module = instantiate_class((), data["model"])
        module.trainer = pl.Trainer(
            strategy=MegatronStrategy(**options),
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with torch.device("meta"):
            module.configure_model()
        ssd = module_sharded_state_dict(module)
        apply_factories(ssd)
        keys = {
            sh.key: (tuple(sh.global_shape), str(sh.dtype).replace("torch.", ""))
            for sh in nested_values(ssd)
            if isinstance(sh, ShardedTensor)
        }
        configs = [
            m.config
            for m in module.modules()
            if isinstance(m, MegatronModule) and hasattr(m, "config")
        ][:1]
    return ModelSpec(keys, configs), target

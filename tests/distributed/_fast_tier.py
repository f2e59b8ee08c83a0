"""The fast tier on one node: a run saves fast steps only, a second resumes the newest exactly.
Shared by the GPU test (``tests/gpu/test_fast_tier_gpu.py``: staged into pinned memory) and its
CPU twins (``tests/distributed/test_fast_tier_one_node.py``: one rank, and 2 ranks across the
optimizers and precisions).

``optimizer``: ``TinyGPTModule``'s (``"adamw"``, ``"distributed"``: Megatron-Core's
distributed optimizer, its persistent tier ``dp_reshardable``), ``"distributed_full"`` (the same,
its persistent tier ``fully_reshardable``) or ``"moe"`` (a mixture of experts at EP=2 on 2
ranks: a chained distributed optimizer of a dense and an expert one). ``precision``: Lightning's,
or ``"megatron-bf16"`` (bf16 weights in ``Float16Module`` with fp32 main parameters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt.testing import run_distributed

FAST = 3
END = 6
MOE = {"num_moe_experts": 4, "moe_router_topk": 2}


def _module_and_strategy(optimizer: str, precision: str, world_size: int) -> tuple[Any, Any]:
    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    options: dict[str, Any] = {}
    if optimizer == "distributed_full":
        options["ckpt_optimizer_sharding"] = "fully_reshardable"
    if optimizer == "moe":
        options["expert_model_parallel_size"] = world_size
    module = TinyGPTModule(
        optimizer="distributed" if optimizer in ("distributed_full", "moe") else optimizer,
        megatron_bf16=precision == "megatron-bf16",
        transformer_config=MOE if optimizer == "moe" else None,
    )
    return module, MegatronStrategy(**options)


def _job(
    rank: int,
    world_size: int,
    tmp: str,
    optimizer: str,
    precision: str,
    accelerator: str,
    ckpt_path: str | None,
    saved_format: int,
) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import gathered_optimizer, gathered_weights, loader, record_losses

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint

    module, strategy = _module_and_strategy(optimizer, precision, world_size)
    if ckpt_path is None and saved_format == 1:
        _save_format_1(strategy.config.ckpt_optimizer_sharding)
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
        strategy=strategy,
        accelerator=accelerator,
        devices=world_size,
        precision="32" if precision == "megatron-bf16" else precision,
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


def _save_format_1(sharding: str) -> None:
    """Make this process's fast saves write rank-state files as format 1 did: the distributed
    optimizer's state in the run's ``sharding``, which the file does not name."""
    from lightning_mcore_ckpt.engine import _rank_state
    from lightning_mcore_ckpt.fast import writer

    stage = writer.stage_rank_state

    def format_1(state: Any, cache: Any) -> dict[str, Any]:
        _rank_state.SHARDING = sharding
        payload = stage(state, cache)
        del payload["optimizer_sharding"]
        return {**payload, "version": 1}

    writer.stage_rank_state = format_1


def resumes_exactly(
    tmp: Path,
    optimizer: str,
    precision: str,
    accelerator: str,
    world_size: int = 1,
    saved_format: int = 2,
) -> None:
    """The check, on ``accelerator`` (its CPU twins run it with ``"cpu"``), on ``world_size``
    ranks of one node: every rank resumed the newest fast step and continued with its losses,
    and the weights and optimizer state (gathered) are the uninterrupted run's, bit for bit.
    ``saved_format``: the rank-state format the first run writes (1: as before the format named
    the optimizer's sharding)."""
    args = (str(tmp), optimizer, precision, accelerator)
    firsts = run_distributed(_job, world_size, *args, None, saved_format)
    agains = run_distributed(_job, world_size, *args, "last", 2)
    newest = (END - 1) // FAST * FAST
    for rank, (first, again) in enumerate(zip(firsts, agains, strict=True)):
        assert again["resumed"] == newest, rank
        assert again["losses"] == {k: v for k, v in first["losses"].items() if k >= newest}, rank
        for name in ("weights", "optim"):
            assert again[name].keys() == first[name].keys(), (rank, name)
            for key, tensor in again[name].items():
                assert torch.equal(tensor, first[name][key]), (rank, name, key)
        if accelerator == "gpu":
            assert first["pinned"] and all(first["pinned"]), first["pinned"]

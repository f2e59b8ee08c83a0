"""LR and weight-decay schedules over the chained optimizer of a mixture of experts.

A tiny Qwen2-MoE (4 experts) trains on 2 gloo processes with ``expert_model_parallel_size=2``
and Megatron-Core's distributed optimizer over Megatron DDP: ``get_megatron_optimizer`` builds a
``ChainedOptimizer`` of a dense and an expert optimizer. The axes:

- the schedule: ``tiny.step_lr`` (a torch ``StepLR`` through ``torch_scheduler``); torch's
  ``SequentialLR`` of ``LinearLR`` warmup and ``CosineAnnealingLR`` through ``torch_scheduler``
  (schedulers of schedulers, from each group's base learning rate); Megatron-Core's
  ``OptimizerParamScheduler`` (linear warmup, cosine decay, a linear weight-decay increment)
  through ``MegatronParamScheduler``;
- the run: uninterrupted for ``TOTAL`` steps, or stopped at ``STOP_AT`` (saved by
  ``MegatronCheckpoint``) and resumed with ``ckpt_path="last"`` in fresh processes.

At every step, every parameter group of both inner optimizers must have the schedule's learning
rate (and weight decay, times the group's ``wd_mult``), and the resumed run's losses, learning
rates and weight decays must be bit-identical to the uninterrupted run's. The pure logic (a
torch optimizer, state round trips, refusals) is in ``tests/unit/test_schedules.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(400)

MOE: dict[str, Any] = dict(family="qwen2_moe", hidden_size=32, intermediate_size=256, num_experts=4)
BATCH = 2
STOP_AT = 3
TOTAL = 6
LR = 1e-2
MIN_LR = 1e-3
WARMUP = 2
END_WD = 0.1
SCHEDULES = ["step_lr", "torch_warmup_cosine", "megatron_cosine"]


def _module(src: str, schedule: str) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from lightning_mcore_ckpt.tiny import HFGPTModule, megatron_ddp, step_lr
    from lightning_mcore_ckpt.training.schedules import MegatronParamScheduler, torch_scheduler

    class ScheduledMoE(HFGPTModule):  # type: ignore[misc]
        def configure_model(self) -> None:
            if self.model is None:
                super().configure_model()
                self.model = megatron_ddp(self.model, distributed_optimizer=True)

        def configure_optimizers(self) -> Any:
            config = OptimizerConfig(
                optimizer="adam",
                lr=LR,
                min_lr=MIN_LR,
                weight_decay=END_WD,
                use_distributed_optimizer=True,
                clip_grad=1.0,
            )
            optimizer = get_megatron_optimizer(config, [self.model])
            if schedule == "step_lr":
                scheduler = step_lr(optimizer, step_size=2, gamma=0.5)
            elif schedule == "torch_warmup_cosine":
                scheduler = torch_scheduler(optimizer, _torch_warmup_cosine)
            else:
                scheduler = MegatronParamScheduler(
                    OptimizerParamScheduler(
                        optimizer,
                        init_lr=0.0,
                        max_lr=LR,
                        min_lr=MIN_LR,
                        lr_warmup_steps=WARMUP,
                        lr_decay_steps=TOTAL,
                        lr_decay_style="cosine",
                        start_wd=0.0,
                        end_wd=END_WD,
                        wd_incr_steps=TOTAL,
                        wd_incr_style="linear",
                    )
                )
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

    return ScheduledMoE(src, lr=LR)


def _torch_warmup_cosine(optimizer: Any) -> Any:
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    warmup = LinearLR(optimizer, start_factor=0.5, total_iters=WARMUP)
    decay = CosineAnnealingLR(optimizer, T_max=TOTAL - WARMUP, eta_min=MIN_LR)
    return SequentialLR(optimizer, [warmup, decay], milestones=[WARMUP])


def _groups(optimizer: Any) -> list[list[tuple[float, float, float]]]:
    """Each inner optimizer's groups: (lr, weight_decay, wd_mult)."""
    return [
        [(g["lr"], g["weight_decay"], g.get("wd_mult", 1.0)) for g in inner.param_groups]
        for inner in optimizer.chained_optimizers
    ]


def _fit(
    world_size: int, tmp: str, schedule: str, max_steps: int, ckpt_path: str | None
) -> dict[str, Any]:
    """Fit to ``max_steps``, saving at ``STOP_AT``; what each step used: loss, groups."""
    import lightning.pytorch as pl
    import torch
    from _trainer import loader, make_trainer, record_losses
    from megatron.core.optimizer import ChainedOptimizer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy

    used: dict[int, Any] = {}

    class RecordGroups(pl.Callback):
        # Before the step's update: the learning rates and weight decays that update uses.
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            optimizer = trainer.optimizers[0]
            assert isinstance(optimizer, ChainedOptimizer)
            used[trainer.global_step] = _groups(optimizer)

    module = _module(str(Path(tmp, "src")), schedule)
    losses = record_losses(module)
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(expert_model_parallel_size=2, init_from=str(Path(tmp, "src"))),
        world_size,
        callbacks=[
            RecordGroups(),
            MegatronCheckpoint(Path(tmp, "ckpt", schedule), every_n_train_steps=STOP_AT),
        ],
        enable_checkpointing=True,
    )
    torch.manual_seed(0)  # the loader's shuffle, alike in every run
    samples = TOTAL * BATCH * world_size
    trainer.fit(module, train_dataloaders=loader(samples, BATCH, shuffle=True), ckpt_path=ckpt_path)
    return {
        "losses": losses,
        "groups": used,
        "inner": len(trainer.optimizers[0].chained_optimizers),
        "scheduler_state": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
    }


def _uninterrupted_and_stopped(
    rank: int, world_size: int, tmp: str, schedule: str
) -> dict[str, Any]:
    full = _fit(world_size, str(Path(tmp, "full")), schedule, TOTAL, None)
    stopped = _fit(world_size, tmp, schedule, STOP_AT, None)
    return {"full": full, "stopped": stopped}


def _resumed(rank: int, world_size: int, tmp: str, schedule: str) -> dict[str, Any]:
    return _fit(world_size, tmp, schedule, TOTAL, "last")


@pytest.fixture(scope="module", params=SCHEDULES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Both runs of one schedule, per rank: uninterrupted and stopped (one set of processes),
    resumed (fresh processes)."""
    from lightning_mcore_ckpt.tiny import tiny_hf_model

    schedule = request.param
    tmp = tmp_path_factory.mktemp(schedule)
    src = tiny_hf_model(tmp / "src", **MOE)
    Path(tmp, "full").mkdir()
    Path(tmp, "full", "src").symlink_to(src)
    first = run_distributed(_uninterrupted_and_stopped, 2, str(tmp), schedule, timeout=300)
    resumed = run_distributed(_resumed, 2, str(tmp), schedule, timeout=300)
    return schedule, [dict(r, resumed=s) for r, s in zip(first, resumed, strict=True)]


def _expected_lr(schedule: str, step: int) -> float:
    if schedule == "step_lr":
        return LR * 0.5 ** (step // 2)
    if schedule == "torch_warmup_cosine":  # the same schedule of one torch optimizer's group
        import torch

        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
        scheduler = _torch_warmup_cosine(optimizer)
        for _ in range(step):
            optimizer.step()
            scheduler.step()
        return float(optimizer.param_groups[0]["lr"])
    if step <= WARMUP:
        return LR * step / WARMUP
    ratio = (step - WARMUP) / (TOTAL - WARMUP)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (LR - MIN_LR)


def test_every_inner_optimizers_groups_follow_the_schedule(runs: Any) -> None:
    schedule, ranks = runs
    for rank, r in enumerate(ranks):
        full = r["full"]
        assert full["inner"] == 2, "EP=2 with the distributed optimizer chains 2 optimizers"
        assert sorted(full["groups"]) == list(range(TOTAL))
        for step, inner in full["groups"].items():
            assert len(inner) == 2 and all(inner), (rank, step, inner)
            lrs = {lr for groups in inner for lr, _, _ in groups}
            assert len(lrs) == 1, f"rank {rank}, step {step}: the groups' learning rates {lrs}"
            assert lrs.pop() == pytest.approx(_expected_lr(schedule, step), rel=1e-12)
            if schedule == "megatron_cosine":  # the weight decay grows, times each wd_mult
                wd = END_WD * step / TOTAL
                for groups in inner:
                    for _, decay, mult in groups:
                        assert decay == pytest.approx(wd * mult, rel=1e-12, abs=0.0)
        # The schedule moved: not one learning rate throughout.
        assert len({g[0][0][0] for g in full["groups"].values()}) > 2


def test_resume_from_last_continues_the_schedule_bit_identically(runs: Any) -> None:
    _, ranks = runs
    for rank, r in enumerate(ranks):
        full, stopped, resumed = r["full"], r["stopped"], r["resumed"]
        assert sorted(stopped["losses"]) == list(range(STOP_AT))
        assert sorted(resumed["losses"]) == list(range(STOP_AT, TOTAL)), "resumed elsewhere"
        for step in range(STOP_AT):
            assert stopped["losses"][step] == full["losses"][step], (rank, step)
            assert stopped["groups"][step] == full["groups"][step], (rank, step)
        for step in range(STOP_AT, TOTAL):
            assert resumed["groups"][step] == full["groups"][step], (rank, step)
            assert resumed["losses"][step] == full["losses"][step], (rank, step)
        assert resumed["scheduler_state"] == full["scheduler_state"]

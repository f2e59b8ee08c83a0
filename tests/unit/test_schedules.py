"""``training.schedules``: torch schedulers and Megatron-Core's ``OptimizerParamScheduler`` over a
torch optimizer and a ``ChainedOptimizer`` of two, without a process group.

The chain is Megatron-Core's own ``ChainedOptimizer`` over two stand-ins for Megatron optimizers
(each a torch optimizer's groups, as ``MegatronOptimizer.param_groups`` returns them; Megatron's
optimizers allocate on CUDA). Training with the real ones, expert parallelism and resume from
checkpoints: ``tests/distributed/test_moe_schedules.py``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR, StepLR

from lightning_mcore_ckpt.training.schedules import MegatronParamScheduler, torch_scheduler

LR = 0.1
STEPS = 7


class _Inner:
    """A Megatron optimizer as ``ChainedOptimizer`` sees it: the groups of a torch optimizer."""

    config = None

    def __init__(self, groups: int) -> None:
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
        self.optimizer = torch.optim.SGD(
            [{"params": [p], "wd_mult": float(i % 2)} for i, p in enumerate(params)], lr=LR
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> None:
        self.optimizer.step()


def _chain() -> Any:
    from megatron.core.optimizer import ChainedOptimizer

    class Chain(ChainedOptimizer):
        # Megatron's step also prepares and clips gradients, which the stand-ins have not.
        def step(self) -> None:  # type: ignore[override]
            for inner in self.chained_optimizers:
                inner.step()

    return Chain([_Inner(2), _Inner(1)])  # type: ignore[list-item]


def _warmup_cosine(optimizer: Any) -> SequentialLR:
    warmup = LinearLR(optimizer, start_factor=0.25, total_iters=2)
    return SequentialLR(optimizer, [warmup, CosineAnnealingLR(optimizer, T_max=5)], milestones=[2])


def _lrs(optimizer: Any) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


def _reference_lrs(build: Any, steps: int) -> list[float]:
    """The schedule of one torch optimizer's one group, step by step."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = build(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_a_torch_optimizer_gets_the_scheduler_build_makes() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = torch_scheduler(optimizer, lambda o: StepLR(o, step_size=2))
    assert isinstance(scheduler, StepLR)
    assert scheduler.optimizer is optimizer


@pytest.mark.parametrize(
    "build", [lambda o: StepLR(o, step_size=2, gamma=0.5), _warmup_cosine], ids=["step", "seq"]
)
def test_every_group_of_every_inner_optimizer_follows_the_schedule(build: Any) -> None:
    chain = _chain()
    scheduler = torch_scheduler(chain, build)
    assert scheduler.optimizer is chain  # what Lightning checks: the optimizer returned
    expected = _reference_lrs(build, STEPS)
    with warnings.catch_warnings():
        # torch warns when the optimizer's step was not seen before the scheduler's.
        warnings.simplefilter("error")
        for step in range(STEPS):
            assert _lrs(chain) == [expected[step]] * 3, step
            for inner in chain.chained_optimizers:
                assert {g["lr"] for g in inner.param_groups} == {expected[step]}
            chain.step()
            scheduler.step()


def test_a_scheduler_restored_into_a_new_chain_continues_exactly() -> None:
    # A load gives the optimizers new group dicts (torch's load_state_dict does): the restored
    # scheduler schedules the groups the chain holds now.
    chain = _chain()
    scheduler = torch_scheduler(chain, _warmup_cosine)
    for _ in range(3):
        chain.step()
        scheduler.step()
    saved_groups = [
        copy.deepcopy(inner.optimizer.state_dict()) for inner in chain.chained_optimizers
    ]
    state = copy.deepcopy(scheduler.state_dict())

    resumed = _chain()
    restored = torch_scheduler(resumed, _warmup_cosine)
    for inner, groups in zip(resumed.chained_optimizers, saved_groups, strict=True):
        inner.optimizer.load_state_dict(groups)
    restored.load_state_dict(copy.deepcopy(state))
    assert restored.state_dict() == state
    for _ in range(STEPS - 3):
        assert _lrs(resumed) == _lrs(chain)
        for c in (chain, resumed):
            c.step()
        scheduler.step()
        restored.step()
    assert restored.state_dict() == scheduler.state_dict()


def test_a_scheduler_of_another_optimizer_is_refused() -> None:
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    with pytest.raises(ValueError, match="construct it on the optimizer build is given"):
        torch_scheduler(_chain(), lambda o: StepLR(other, step_size=2))
    with pytest.raises(TypeError, match="has no param_groups"):
        torch_scheduler(object(), lambda o: StepLR(o, step_size=2))


def _megatron(optimizer: Any, **overrides: Any) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    options: dict[str, Any] = dict(
        init_lr=0.0,
        max_lr=LR,
        min_lr=LR / 10,
        lr_warmup_steps=2,
        lr_decay_steps=STEPS,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=STEPS,
        wd_incr_style="linear",
    )
    options.update(overrides)
    return OptimizerParamScheduler(optimizer, **options)


def _wds(optimizer: Any) -> list[float]:
    return [group["weight_decay"] for group in optimizer.param_groups]


@pytest.mark.parametrize("increment", [1, 3])
def test_megatron_schedule_steps_every_group_by_its_increment(increment: int) -> None:
    from lightning.pytorch.utilities.types import LRSchedulerTypeTuple

    chain = _chain()
    scheduler = MegatronParamScheduler(_megatron(chain), increment=increment)
    assert isinstance(scheduler, LRSchedulerTypeTuple)  # Lightning steps it as it is
    assert scheduler.optimizer is chain
    reference = _megatron(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR))
    for step in range(STEPS // increment):
        assert scheduler.scheduler.num_steps == step * increment
        group = {"wd_mult": 1.0}
        lr, wd = reference.get_lr(group), reference.get_wd()
        assert _lrs(chain) == [lr] * 3 == scheduler.get_last_lr(), step
        assert _wds(chain) == [0.0, wd, 0.0], step  # times each group's wd_mult
        scheduler.step()
        reference.step(increment)


def test_megatron_schedule_restores_its_step_and_the_checkpoints_settings() -> None:
    chain = _chain()
    scheduler = MegatronParamScheduler(_megatron(chain))
    for _ in range(3):
        scheduler.step()
    state = scheduler.state_dict()
    assert state["num_steps"] == 3

    # A scheduler that already stepped, built with another weight-decay increment: the
    # checkpoint's count and settings win (use_checkpoint_opt_param_scheduler, the default).
    resumed = _chain()
    restored = MegatronParamScheduler(_megatron(resumed, end_wd=0.5))
    restored.step()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert _lrs(resumed) == _lrs(chain) == restored.get_last_lr()
    assert _wds(resumed) == _wds(chain)
    for _ in range(STEPS - 3):
        scheduler.step()
        restored.step()
        assert (_lrs(resumed), _wds(resumed)) == (_lrs(chain), _wds(chain))


def test_megatron_schedule_refusals() -> None:
    chain = _chain()
    with pytest.raises(ValueError, match=r"increment=0"):
        MegatronParamScheduler(_megatron(chain), increment=0)
    for group in chain.param_groups:
        group["min_lr"] = None  # as OptimizerConfig(min_lr=None) leaves Megatron's groups
    with pytest.raises(ValueError, match=r"min_lr=None.*OptimizerConfig\(lr=\.\.\., min_lr"):
        MegatronParamScheduler(_megatron(chain))
    with pytest.raises(TypeError, match=r"call step\(\)"):
        MegatronParamScheduler(_megatron(_chain())).step(3)

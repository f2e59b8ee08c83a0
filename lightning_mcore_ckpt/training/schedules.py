"""Learning-rate and weight-decay schedules over torch and Megatron-Core optimizers, chained or not.

A Megatron-Core optimizer is not a ``torch.optim.Optimizer``: its parameter groups live in the
torch optimizers inside it, and a ``ChainedOptimizer`` (what ``get_megatron_optimizer`` builds
with expert parallelism: a dense and an expert optimizer) has several of them. Its
``param_groups`` is the concatenation of theirs (the same group dicts, read anew at each call).
Two ways to schedule them inside a Lightning ``Trainer``, both stepping *every* group and both
saved and restored by Lightning's checkpoint (``state_dict`` / ``load_state_dict``):

- :func:`torch_scheduler`: any torch scheduler (``StepLR``, ``SequentialLR`` of a warmup and a
  cosine, ...), built over the optimizer's parameter groups as they are at each step.
- :class:`MegatronParamScheduler`: Megatron-Core's own ``OptimizerParamScheduler`` (warmup,
  linear/cosine/WSD/inverse-square-root decay, weight-decay increment), as the torch scheduler
  Lightning steps.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["MegatronParamScheduler", "torch_scheduler"]

SchedulerT = TypeVar("SchedulerT", bound=LRScheduler)


class _ParamGroups(torch.optim.Optimizer):
    """An optimizer's parameter groups, as the ``torch.optim.Optimizer`` a torch scheduler
    needs to be built on; read from the optimizer at every access, so that groups a checkpoint
    load replaced are the ones scheduled."""

    def __init__(self, optimizer: Any) -> None:
        # Not Optimizer.__init__: it would copy the groups into new dicts of its own.
        self._source = optimizer
        self.defaults: dict[str, Any] = {}
        self.state: defaultdict[Any, Any] = defaultdict(dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return list(self._source.param_groups)

    @property
    def _opt_called(self) -> bool:
        # torch's mark that the optimizer stepped, checked by schedulers built on this view
        # (the parts of a SequentialLR): the optimizer's own (see _mark_steps).
        return bool(getattr(self._source, "_opt_called", False))

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError(
            f"the parameter groups of {type(self._source).__name__} are stepped by that "
            "optimizer, not by this view of them"
        )


def _mark_steps(optimizer: Any) -> None:
    """Wrap this instance's ``step`` as a torch scheduler wraps its torch optimizer's: the
    wrapper marks the optimizer as stepped, which torch's "optimizer.step() overridden / not
    called before lr_scheduler.step()" warnings check. Nothing else changes."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)

    @functools.wraps(step)
    def marked_step(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        if opt is not None:
            opt._opt_called = True
        return step(*args, **kwargs)

    marked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked_step


def torch_scheduler(
    optimizer: Any, build: Callable[[torch.optim.Optimizer], SchedulerT]
) -> SchedulerT:
    """A torch LR scheduler over every parameter group of ``optimizer``: a torch optimizer, a
    Megatron-Core ``MegatronOptimizer`` or a ``ChainedOptimizer`` of several.

    ``build`` constructs the scheduler on the torch optimizer it is given: for a torch optimizer,
    ``optimizer`` itself; otherwise a view of ``optimizer.param_groups`` (for a chain, every inner
    optimizer's groups, in the chain's order). The scheduler returned names ``optimizer`` as its
    own, as Lightning requires of a scheduler returned with it, and keeps stepping the groups
    ``optimizer`` holds at each step (a checkpoint load replaces them). Its ``state_dict`` is
    torch's; the learning rates themselves are restored with the optimizer's state, as for any
    torch scheduler. As torch does to a torch optimizer, the optimizer's ``step`` is wrapped to
    mark that it ran (torch checks it before a scheduler's first step).

    Args:
        optimizer: what ``configure_optimizers`` returns as the optimizer.
        build: the scheduler, from the optimizer to schedule, e.g.
            ``lambda o: StepLR(o, step_size=2, gamma=0.5)``. Schedulers made of schedulers
            (``SequentialLR``, ``ChainedScheduler``) build their parts on the same ``o``.

    Raises:
        ValueError: ``build`` returned a scheduler of another optimizer.
        TypeError: ``optimizer`` has no ``param_groups``.

    Example::

        def configure_optimizers(self):
            optimizer = get_megatron_optimizer(config, [self.model])  # chained with EP > 1
            scheduler = torch_scheduler(
                optimizer,
                lambda o: SequentialLR(o, [LinearLR(o, 0.1, total_iters=100),
                                           CosineAnnealingLR(o, T_max=900)], milestones=[100]),
            )
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return _built_on(optimizer, build)
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"torch_scheduler: {type(optimizer).__name__} has no param_groups; pass a torch "
            "optimizer or a Megatron-Core optimizer"
        )
    scheduler = _built_on(_ParamGroups(optimizer), build)
    scheduler.optimizer = optimizer
    _mark_steps(optimizer)
    return scheduler


def _built_on(optimizer: torch.optim.Optimizer, build: Callable[[Any], SchedulerT]) -> SchedulerT:
    scheduler = build(optimizer)
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError(
            f"torch_scheduler: build returned {type(scheduler).__name__} of another optimizer; "
            "construct it on the optimizer build is given (lambda o: StepLR(o, ...))"
        )
    return scheduler


def _check_group_bounds(optimizer: Any) -> None:
    """Refuse groups whose own learning-rate bounds are unset: ``OptimizerParamScheduler``
    prefers a group's ``max_lr``/``min_lr`` (a Megatron-Core optimizer's groups carry
    ``OptimizerConfig.lr``/``min_lr``) to its own, and fails at the first decay step on ``None``."""
    for i, group in enumerate(optimizer.param_groups):
        unset = [key for key in ("max_lr", "min_lr") if key in group and group[key] is None]
        if unset:
            raise ValueError(
                f"MegatronParamScheduler: parameter group {i} has {unset[0]}=None, which "
                "OptimizerParamScheduler uses instead of its own; set OptimizerConfig(lr=..., "
                "min_lr=...) to the schedule's max_lr and min_lr"
            )


class MegatronParamScheduler(LRScheduler):
    """Megatron-Core's ``OptimizerParamScheduler`` as the torch scheduler Lightning steps and
    checkpoints.

    ``OptimizerParamScheduler`` sets every parameter group's learning rate (warmup, then
    ``lr_decay_style``: constant, linear, cosine, inverse-square-root, WSD) and weight decay
    (``start_wd`` to ``end_wd`` by ``wd_incr_style``, times the group's ``wd_mult``) from its
    step count. It steps with ``step(increment)`` and is not a torch scheduler, so Lightning would
    refuse it; this adapter is one. Each :meth:`step` (Lightning's, at its ``interval``) advances
    the schedule by ``increment``: 1 to count optimizer steps, or the global batch size to count
    samples as Megatron-LM does. Works for a torch optimizer, a ``MegatronOptimizer`` and a
    ``ChainedOptimizer`` (every inner optimizer's groups).

    A group's own ``max_lr``, ``min_lr``, ``start_wd``, ``end_wd`` and ``wd_mult`` win over the
    scheduler's: a Megatron-Core optimizer gives each group ``max_lr=OptimizerConfig.lr`` and
    ``min_lr=OptimizerConfig.min_lr`` (``None`` unless set: refused here), and ``wd_mult=0``
    to biases and norms (no weight decay).

    Saved: :meth:`state_dict` is ``OptimizerParamScheduler.state_dict()`` (what Megatron-LM saves
    as ``opt_param_scheduler``: the step count and the schedule's settings), in Lightning's
    checkpoint. :meth:`load_state_dict` restores the step count whatever the scheduler's own,
    then sets every group's learning rate and weight decay from the restored schedule, so a
    resumed run continues exactly. With ``use_checkpoint_opt_param_scheduler=True`` (Megatron's
    default), the checkpoint's settings win over the constructor's.

    Args:
        scheduler: the ``OptimizerParamScheduler`` of the optimizer ``configure_optimizers``
            returns (its ``optimizer``).
        increment: how far one :meth:`step` advances the schedule.

    Example::

        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        def configure_optimizers(self):
            optimizer = get_megatron_optimizer(config, [self.model])
            schedule = OptimizerParamScheduler(
                optimizer, init_lr=0.0, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=100,
                lr_decay_steps=1000, lr_decay_style="cosine", start_wd=0.0, end_wd=0.1,
                wd_incr_steps=1000, wd_incr_style="linear",
            )
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": MegatronParamScheduler(schedule), "interval": "step"}}
    """

    def __init__(self, scheduler: OptimizerParamScheduler, increment: int = 1) -> None:
        # Not LRScheduler.__init__: it would take the current learning rates as the schedule's
        # base and step once; the schedule is Megatron's, which set the groups when it was built.
        if increment < 1:
            raise ValueError(
                f"MegatronParamScheduler(increment={increment!r}): a step advances the schedule "
                "by at least 1 (1 per optimizer step, or the global batch size to count samples)"
            )
        _check_group_bounds(scheduler.optimizer)
        self.scheduler = scheduler
        self.optimizer: Any = scheduler.optimizer
        self.increment = increment
        self._last_lr = self._learning_rates()

    def _learning_rates(self) -> list[Any]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_lr(self) -> list[Any]:
        """The learning rate of each parameter group at the schedule's current step."""
        return [self.scheduler.get_lr(group) for group in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        """Advance the schedule by ``increment`` and set every group's learning rate and weight
        decay."""
        if epoch is not None:
            raise TypeError(
                "MegatronParamScheduler.step(epoch): the schedule only moves forward by its "
                "increment; call step()"
            )
        self.scheduler.step(self.increment)
        self._last_lr = self._learning_rates()

    def state_dict(self) -> dict[str, Any]:
        """``OptimizerParamScheduler.state_dict()``."""
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule and set every group's learning rate and weight decay from it."""
        # OptimizerParamScheduler.load_state_dict adds the saved count to its own, and sets the
        # weight decay before it reads the saved weight-decay settings: start from 0, re-apply.
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(dict(state_dict))
        self.scheduler.step(0)
        self._last_lr = self._learning_rates()

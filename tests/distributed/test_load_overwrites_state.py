"""A load creates the optimizer's state uninitialised (no memset of the moments) and overwrites
every element of it; a load that fails leaves the optimizer with no state, never with memory
no load wrote.

The state a load creates is poisoned with NaN here (where it would be left uninitialised):
after the load, no NaN may remain in any state tensor, and the state equals the one saved.

Axes: the optimizer (torch AdamW; Megatron-Core's distributed optimizer saved
``dp_reshardable`` and ``fully_reshardable``; a mixture of experts at EP=2, whose distributed
optimizer is a ``ChainedOptimizer`` of a dense and an expert one) by the layout at load (the
saving one; another: TP=2 for the dense models, EP=1 for the mixture of experts; not for
``dp_reshardable``, which reshards across data-parallel sizes only), on 2 gloo ranks; and a load
whose optimizer part fails after the state was created, for each optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

MOE = {"num_moe_experts": 4, "moe_router_topk": 2}
OPTIMIZERS = ("adamw", "distributed", "distributed_full", "moe")
LAYOUTS = ("same", "resharded")


def _layouts(optimizer: str) -> tuple[str, ...]:
    # dp_reshardable reshards across data-parallel sizes only: on 2 ranks, its saving layout.
    return ("same",) if optimizer == "distributed" else LAYOUTS


def _strategy(optimizer: str, layout: str) -> Any:
    from lightning_mcore_ckpt import MegatronStrategy

    sharding = "fully_reshardable" if optimizer in ("distributed_full", "moe") else None
    options = {"ckpt_optimizer_sharding": sharding} if sharding else {}
    if optimizer == "moe":
        return MegatronStrategy(expert_model_parallel_size=2 if layout == "same" else 1, **options)
    return MegatronStrategy(tensor_model_parallel_size=1 if layout == "same" else 2, **options)


def _module(optimizer: str) -> Any:
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    if optimizer == "moe":
        return TinyGPTModule(optimizer="distributed", dropout=0.0, transformer_config=MOE)
    name = "distributed" if optimizer.startswith("distributed") else optimizer
    return TinyGPTModule(optimizer=name, dropout=0.0)


@contextlib.contextmanager
def _poisoned() -> Iterator[list[int]]:
    """State a load leaves uninitialised is NaN instead; yields the count of tensors made so."""
    from lightning_mcore_ckpt.training import optim

    made: list[int] = []
    stock = optim._Uninitialised.__torch_function__

    def poison(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.zeros_like:
            made.append(1)
            return torch.full_like(*args, float("nan"), **(kwargs or {}))
        return stock(self, func, types, args, kwargs)

    optim._Uninitialised.__torch_function__ = poison  # type: ignore[method-assign]
    try:
        yield made
    finally:
        optim._Uninitialised.__torch_function__ = stock  # type: ignore[method-assign]


def _inner_states(strategy: Any) -> list[dict[Any, Any]]:
    """The per-parameter state of every torch optimizer the run's optimizers hold."""
    from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

    states = []
    for opt in strategy._torch_optimizers():
        inner = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
        for o in inner:
            states.append((o.optimizer if isinstance(o, MegatronOptimizer) else o).state)
    return states


def _load(rank: int, world_size: int, tmp: str, optimizer: str) -> dict[str, Any]:
    from _trainer import gathered_optimizer, loader, make_trainer

    step = str(Path(tmp, "step"))
    trainer = make_trainer(2, _strategy(optimizer, "same"), world_size)
    trainer.fit(_module(optimizer), train_dataloaders=loader(16, 2, shuffle=True))
    trainer.save_checkpoint(step)
    saved = gathered_optimizer(trainer)
    trainer.strategy.teardown()
    out: dict[str, Any] = {}
    for layout in _layouts(optimizer):
        strategy = _strategy(optimizer, layout)
        stock = strategy.load_checkpoint
        found: dict[str, Any] = {}

        def load_checkpoint(
            *args: Any,
            _stock: Any = stock,
            _found: Any = found,
            _strategy: Any = strategy,
            **kwargs: Any,
        ) -> Any:
            with _poisoned() as made:
                loaded = _stock(*args, **kwargs)
            _found["poisoned"] = len(made)
            _found["nan"] = sum(
                int(torch.isnan(t).any())
                for state in _inner_states(_strategy)
                for per_param in state.values()
                for t in per_param.values()
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            )
            return loaded

        strategy.load_checkpoint = load_checkpoint
        trainer = make_trainer(2, strategy, world_size)  # at the saved step: loads, no step
        trainer.fit(
            _module(optimizer), train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=step
        )
        loaded = gathered_optimizer(trainer)
        out[layout] = {
            **found,
            "equal": sorted(saved) == sorted(loaded)
            and all(torch.equal(saved[k], loaded[k]) for k in saved),
        }
        strategy.teardown()
    return out


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_load_overwrites_every_element_of_the_state_it_creates(
    tmp_path: Path, optimizer: str
) -> None:
    results = run_distributed(_load, 2, str(tmp_path), optimizer, timeout=280)
    for rank, out in enumerate(results):
        for layout in _layouts(optimizer):
            got = out[layout]
            # The poison reached the state (the check would prove nothing otherwise)...
            assert got["poisoned"] > 0, (rank, layout, got)
            # ...and the load overwrote all of it, with what was saved.
            assert got["nan"] == 0, (rank, layout, got)
            assert got["equal"], (rank, layout, got)


def _failed_load(rank: int, world_size: int, tmp: str, optimizer: str) -> dict[str, Any]:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt.engine import _reader

    step = str(Path(tmp, "step"))
    trainer = make_trainer(2, _strategy(optimizer, "same"), world_size)
    trainer.fit(_module(optimizer), train_dataloaders=loader(16, 2, shuffle=True))
    trainer.save_checkpoint(step)
    trainer.strategy.teardown()

    stock = _reader.CheckpointReader._sharded_load

    def failing(self: Any, template: Any, directory: Path, trusted: bool) -> Any:
        if directory.name == "optim":  # after the state was created, before it is read
            raise OSError(5, "Input/output error", str(directory))
        return stock(self, template, directory, trusted)

    _reader.CheckpointReader._sharded_load = failing  # type: ignore[method-assign]
    strategy = _strategy(optimizer, "same")
    trainer = make_trainer(2, strategy, world_size)
    try:
        trainer.fit(
            _module(optimizer), train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=step
        )
    except OSError as err:
        error = str(err)
    else:
        error = None
    finally:
        _reader.CheckpointReader._sharded_load = stock  # type: ignore[method-assign]
    return {"error": error, "entries": [len(state) for state in _inner_states(strategy)]}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_failed_load_leaves_the_optimizer_without_state(tmp_path: Path, optimizer: str) -> None:
    results = run_distributed(_failed_load, 2, str(tmp_path), optimizer, timeout=280)
    for rank, out in enumerate(results):
        assert out["error"] is not None and "Input/output error" in out["error"], (rank, out)
        assert out["entries"] and all(n == 0 for n in out["entries"]), (rank, out)

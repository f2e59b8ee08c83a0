"""A load creates the optimizer's state uninitialised (no memset of the moments) and overwrites
every element of it; a load that fails leaves the optimizer with no state, never with memory
no load wrote.

The state a load creates is poisoned with NaN here (where it would be left uninitialised):
after the load, no NaN may remain in any state tensor, and the state equals the one saved.

Axes: the optimizer (torch AdamW; Megatron-Core's distributed optimizer saved
``dp_reshardable`` and ``fully_reshardable``; a mixture of experts at EP=2, whose distributed
optimizer is a ``ChainedOptimizer`` of a dense and an expert one) by the tier loaded (the
persistent tier, in the saving layout and in another: TP=2 for the dense models, EP=1 for the
mixture of experts; not for ``dp_reshardable``, which reshards across data-parallel sizes only;
the fast tier, each rank its own file, in the saving layout, which is the only one it resumes),
on 2 gloo ranks; and a load whose optimizer part fails after the state was created, for each
optimizer and tier. A fast-tier load is each rank's alone: it agrees nothing over the ranks (a
rank whose file failed would otherwise leave the others waiting in a collective).
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
TIERS = ("persistent", "fast")
LAYOUTS = ("same", "resharded")
FAST = 2  # the fast tier's cadence; the runs save its step 2 and resume it


def _layouts(optimizer: str, tier: str) -> tuple[str, ...]:
    # dp_reshardable reshards across data-parallel sizes only: on 2 ranks, its saving layout.
    # A fast-tier step resumes only the layout that saved it.
    return ("same",) if optimizer == "distributed" or tier == "fast" else LAYOUTS


def _checkpointing(tier: str, tmp: str) -> tuple[list[Any], str]:
    """The callbacks a run of ``tier`` saves with, and the ``ckpt_path`` that resumes it."""
    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint

    if tier == "persistent":
        return [], str(Path(tmp, "step"))
    checkpoint = MegatronCheckpoint(
        str(Path(tmp, "ckpt")),
        every_n_train_steps=1000,
        save_last=False,
        fast_tier=FastTier(str(Path(tmp, "fast")), every_n_train_steps=FAST, replicas=0),
    )
    return [checkpoint], "last"


def _trainer_for(
    tier: str, tmp: str, strategy: Any, world_size: int, steps: int = FAST, extra: Any = ()
) -> tuple[Any, str]:
    """A trainer of ``steps`` for ``tier`` (callbacks ``extra`` too), and the ``ckpt_path``
    that resumes what it saved."""
    from _trainer import make_trainer

    callbacks, ckpt_path = _checkpointing(tier, tmp)
    trainer = make_trainer(
        steps,
        strategy,
        world_size,
        callbacks=[*callbacks, *extra],
        enable_checkpointing=bool(callbacks),
    )
    return trainer, ckpt_path


def _save(tier: str, tmp: str, optimizer: str, world_size: int) -> tuple[Any, str]:
    """Train and save step :data:`FAST` in ``tier``: the optimizer's state at that step
    (gathered) and the ``ckpt_path`` to resume it. The fast tier saves no step a fit ends at:
    its run trains one step more."""
    import lightning.pytorch as pl
    from _trainer import gathered_optimizer, loader

    saved: dict[str, Any] = {}

    class AtTheSavedStep(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == FAST:
                saved.update(gathered_optimizer(trainer))

    steps = FAST if tier == "persistent" else FAST + 1
    trainer, ckpt_path = _trainer_for(
        tier, tmp, _strategy(optimizer, "same"), world_size, steps, [AtTheSavedStep()]
    )
    trainer.fit(_module(optimizer), train_dataloaders=loader(16, 2, shuffle=True))
    if tier == "persistent":
        trainer.save_checkpoint(ckpt_path)
    trainer.strategy.teardown()
    return saved, ckpt_path


def _recovered_tier(tmp: str) -> str | None:
    """The tier the last recovery of a fast-tier run chose (its record), ``None``: none."""
    import json

    records = Path(tmp, "ckpt", "fast_tier.jsonl")
    if not records.exists():
        return None
    found = [
        r for r in map(json.loads, records.read_text().splitlines()) if r["kind"] == "recovery"
    ]
    return found[-1]["tier"] if found else None


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


def _load(rank: int, world_size: int, tmp: str, optimizer: str, tier: str) -> dict[str, Any]:
    from _received import record_received
    from _trainer import gathered_optimizer, loader

    from lightning_mcore_ckpt.engine import _rank_state
    from lightning_mcore_ckpt.training import optim

    saved, ckpt_path = _save(tier, tmp, optimizer, world_size)
    # The collectives a fast-tier load of a rank's file makes (none: each rank's alone).
    collectives: list[tuple[str, int]] = []
    in_rank_load = {"on": False}
    record_received(collectives, lambda: in_rank_load["on"])
    rank_load = _rank_state.load

    def recorded_rank_load(*args: Any, **kwargs: Any) -> Any:
        in_rank_load["on"] = True
        try:
            return rank_load(*args, **kwargs)
        finally:
            in_rank_load["on"] = False

    _rank_state.load = recorded_rank_load
    agreements: list[int] = []
    agree = optim._agree

    def agreed(*args: Any) -> Any:
        agreements.append(1)
        return agree(*args)

    out: dict[str, Any] = {}
    for layout in _layouts(optimizer, tier):
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
            agreements.clear()
            collectives.clear()
            optim._agree = agreed
            try:
                with _poisoned() as made:
                    loaded = _stock(*args, **kwargs)
            finally:
                optim._agree = agree
            _found["poisoned"] = len(made)
            _found["agreements"] = len(agreements)
            _found["rank_file_collectives"] = list(collectives)
            _found["nan"] = sum(
                int(torch.isnan(t).any())
                for state in _inner_states(_strategy)
                for per_param in state.values()
                for t in per_param.values()
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            )
            return loaded

        strategy.load_checkpoint = load_checkpoint
        # At the saved step: loads, no step.
        trainer, _ = _trainer_for(tier, tmp, strategy, world_size)
        trainer.fit(
            _module(optimizer), train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=ckpt_path
        )
        loaded = gathered_optimizer(trainer)
        out[layout] = {
            **found,
            "step": trainer.global_step,
            "tier": _recovered_tier(tmp),
            "equal": sorted(saved) == sorted(loaded)
            and all(torch.equal(saved[k], loaded[k]) for k in saved),
        }
        strategy.teardown()
    return out


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_load_overwrites_every_element_of_the_state_it_creates(
    tmp_path: Path, optimizer: str, tier: str
) -> None:
    results = run_distributed(_load, 2, str(tmp_path), optimizer, tier, timeout=280)
    for rank, out in enumerate(results):
        for layout in _layouts(optimizer, tier):
            got = out[layout]
            assert got["step"] == FAST, (rank, layout, got)
            # The step came from the tier under test (a fast-tier run records its recovery).
            assert got["tier"] == (None if tier == "persistent" else "fast"), (rank, layout, got)
            # The poison reached the state (the check would prove nothing otherwise)...
            assert got["poisoned"] > 0, (rank, layout, got)
            # ...and the load overwrote all of it, with what was saved.
            assert got["nan"] == 0, (rank, layout, got)
            assert got["equal"], (rank, layout, got)
            # A torch optimizer's template waits for no other rank, in either tier...
            assert got["agreements"] == 0, (rank, layout, got)
            # ...and a fast-tier load of a rank's file makes no collective at all.
            assert got["rank_file_collectives"] == [], (rank, layout, got)


def _failed_load(rank: int, world_size: int, tmp: str, optimizer: str, tier: str) -> dict[str, Any]:
    from _trainer import loader

    from lightning_mcore_ckpt.engine import _rank_state, _reader

    _, ckpt_path = _save(tier, tmp, optimizer, world_size)

    def error(where: Any) -> OSError:
        return OSError(5, "Input/output error", str(where))

    # Each fails after the optimizer's state was created, before any of it is read.
    stock_sharded = _reader.CheckpointReader._sharded_load
    stock_restore = _rank_state._restore

    def failing_sharded(self: Any, template: Any, directory: Path, trusted: bool) -> Any:
        if directory.name == "optim":
            raise error(directory)
        return stock_sharded(self, template, directory, trusted)

    def failing_restore(template: Any, part: Any, device: Any) -> Any:
        if any(key.startswith("optimizer_") for key in template):
            raise error("the rank state's optimizers")
        return stock_restore(template, part, device)

    _reader.CheckpointReader._sharded_load = failing_sharded  # type: ignore[method-assign]
    _rank_state._restore = failing_restore
    strategy = _strategy(optimizer, "same")
    trainer, _ = _trainer_for(tier, tmp, strategy, world_size)
    try:
        trainer.fit(
            _module(optimizer), train_dataloaders=loader(16, 2, shuffle=True), ckpt_path=ckpt_path
        )
    except OSError as err:
        raised = str(err)
    else:
        raised = None
    finally:
        _reader.CheckpointReader._sharded_load = stock_sharded  # type: ignore[method-assign]
        _rank_state._restore = stock_restore
    return {"error": raised, "entries": [len(state) for state in _inner_states(strategy)]}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_failed_load_leaves_the_optimizer_without_state(
    tmp_path: Path, optimizer: str, tier: str
) -> None:
    results = run_distributed(_failed_load, 2, str(tmp_path), optimizer, tier, timeout=280)
    for rank, out in enumerate(results):
        assert out["error"] is not None and "Input/output error" in out["error"], (rank, out)
        assert out["entries"] and all(n == 0 for n in out["entries"]), (rank, out)

"""A save maps the optimizers' state onto the model's sharded dict of the same save (as
Megatron-LM maps them onto the dict it saves), instead of building the model's a second time:
mapping them must leave that dict exactly as it was (the model's part is planned from it after),
and give the same optimizer dict as a model dict of its own would.

Axes: the optimizer (torch AdamW; Megatron-Core's optimizer; its distributed optimizer saved
``dp_reshardable`` and ``fully_reshardable``; a mixture of experts' ``ChainedOptimizer`` of a
dense and an expert distributed optimizer at EP=2), on 2 gloo ranks (DP=2, or EP=2), after
a training step. Every rank checks: every value of the model's dict is the same object with the
same fields and the same data object before and after; both optimizer dicts have the same
entries, field by field, with equal data (factories built first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

CASES = {
    "adamw": ("adamw", "dp_reshardable"),
    "megatron": ("megatron", "dp_reshardable"),
    "distributed-dp_reshardable": ("distributed", "dp_reshardable"),
    "distributed-fully_reshardable": ("distributed", "fully_reshardable"),
    "moe-chained-ep2": ("moe", "fully_reshardable"),
}


def _walk(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _walk(v, f"{path}/{k}")]
    if isinstance(value, list | tuple):
        return [item for i, v in enumerate(value) for item in _walk(v, f"{path}/{i}")]
    return [(path, value)]


def _fields(value: Any) -> dict[str, Any]:
    return (
        {k: v for k, v in vars(value).items() if k != "data"} if hasattr(value, "__dict__") else {}
    )


def _snapshot(ssd: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every leaf of a sharded dict: where, which object, its fields, which data object."""
    return [
        (path, id(v), type(v), repr(_fields(v)), id(getattr(v, "data", None)))
        for path, v in _walk(ssd)
    ]


def _same(a: Any, b: Any) -> bool:
    """Equal values: tensors element for element, objects field by field (factories are
    compared by what they build: their functions are closures made for each dict)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if hasattr(a, "__dict__") and not callable(a):
        fields, others = _fields(a), _fields(b)
        return (
            fields.keys() == others.keys()
            and all(_same(fields[k], others[k]) for k in fields)
            and _same(getattr(a, "data", None), getattr(b, "data", None))
        )
    if isinstance(a, dict | list | tuple):
        left, right = _walk(a), _walk(b)
        return [p for p, _ in left] == [p for p, _ in right] and all(
            _same(x, y) for (_, x), (_, y) in zip(left, right, strict=True)
        )
    return bool(a == b)


def _map(rank: int, world_size: int, tmp: str, optimizer: str, sharding: str) -> dict[str, Any]:
    from _trainer import loader, make_trainer
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.engine._state_dicts import optimizers_to_save
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    if optimizer == "moe":
        from _moe import hf_source, moe_module

        module = moe_module(hf_source(tmp))
        strategy = MegatronStrategy(expert_model_parallel_size=2, ckpt_optimizer_sharding=sharding)
    else:
        module = TinyGPTModule(optimizer=optimizer)
        strategy = MegatronStrategy(ckpt_optimizer_sharding=sharding)
    trainer = make_trainer(1, strategy, world_size)
    trainer.fit(module, train_dataloaders=loader(16, 2))
    state = strategy._training_state()
    model_ssd = state.model_sharded_state_dict()
    before = _snapshot(model_ssd)
    onto_it = optimizers_to_save(state, model_ssd)[0]
    after = _snapshot(model_ssd)
    own = optimizers_to_save(state)[0]
    apply_factories(onto_it)
    apply_factories(own)
    kinds = {type(o).__name__ for o in state.optimizers}
    return {
        "unchanged": before == after,
        "leaves": len(before),
        "same_optimizer_dict": _same(onto_it, own),
        "optimizer_leaves": len(_walk(own)),
        "kinds": sorted(kinds),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_mapping_the_optimizers_onto_the_models_dict_leaves_it_as_it_was(
    tmp_path: Path, case: str
) -> None:
    optimizer, sharding = CASES[case]
    results = run_distributed(_map, 2, str(tmp_path), optimizer, sharding, timeout=240)
    for rank, out in enumerate(results):
        assert out["leaves"] > 0 and out["optimizer_leaves"] > 0, (rank, out)
        assert out["unchanged"], (rank, out)
        assert out["same_optimizer_dict"], (rank, out)
    if optimizer == "moe":
        assert results[0]["kinds"] == ["ChainedOptimizer"], results[0]

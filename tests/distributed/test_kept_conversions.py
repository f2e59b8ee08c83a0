"""Megatron-Core's torch sharded tensors kept from one save to the next (cached plans): every
save writes the state it was called with, bit for bit, and nothing saved stays alive after.

Axes: sync/async x layout (TP=2; PP=2, each stage a rank of its own; DP=2, where Megatron-Core's
fully parallel save hands each rank part of the replicated tensors and caches that too) x the
state's memory (updated in place, as a plain model's is; new tensors after every save, as state
that is gathered, offloaded or rebuilt has: a save that wrote the tensors it kept would write
the step before's values) x save (the first, converted afresh; the later ones, their
conversions kept), on 2 gloo ranks, 5
steps each saved: each step's model/ and optim/ are read back whole and compared with the live
state of that step. And on one rank, the conversion itself: a kept tensor holds no data between
saves, a shard that differs in shape, offset or dtype is converted afresh, and a load goes
straight to Megatron-Core.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

STEPS = 5
LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
    "dp2": {},
}


def _whole(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a dist-checkpoint directory, whole (read on one process)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(str(directory)),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _reallocate(module: Any, optimizer: Any) -> None:
    """New memory for every parameter and optimizer state, the same values (state that is
    gathered, offloaded or rebuilt between saves)."""
    with torch.no_grad():
        for param in module.parameters():
            param.data = param.data.clone()
    for state in optimizer.state.values():
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor):
                state[name] = value.clone()


def _saves_every_step(
    rank: int, world_size: int, root: str, layout: str, async_save: bool, memory: str
) -> Any:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.engine._state_dicts import optimizers_to_save
    from lightning_mcore_ckpt.testing import gather_sharded
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    live: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    reused: list[int] = []

    class SaveEveryStep(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            strategy = trainer.strategy
            step = trainer.global_step
            model = gather_sharded(strategy.model_sharded_state_dict())
            optim = gather_sharded(optimizers_to_save(strategy._training_state())[0])
            live[step] = {"model": model, "optim": optim}
            trainer.save_checkpoint(f"{root}/global_step_{step}")
            strategy._writer.finalize(blocking=True)
            kept = [entry[1] for entry in strategy._writer.plans._kept.values()]
            reused.append(
                sum(getattr(s, "base_strategy", s).conversions.reused for s in kept)
                if strategy._writer.plans.reused
                else 0
            )
            if memory == "new":
                _reallocate(module, trainer.optimizers[0])

    torch.manual_seed(0)
    strategy = MegatronStrategy(ckpt_async_save=async_save, **LAYOUTS[layout])
    trainer = make_trainer(STEPS, strategy, world_size, callbacks=[SaveEveryStep()])
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(32, 2))
    if rank != 0:
        return {"reused": reused}
    differ = []
    for step, parts in live.items():
        for part, expected in parts.items():
            saved = _whole(Path(root) / f"global_step_{step}" / part)
            for key, value in expected.items():
                if key not in saved or not torch.equal(saved[key], value):
                    differ.append(f"step {step} {part}/{key}")
            assert set(saved) <= set(expected) | {k for k in saved if "_extra_state" in k}
    return {"reused": reused, "differ": differ, "steps": sorted(live)}


@pytest.mark.parametrize("memory", ["in_place", "new"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_save_writes_its_own_state_with_conversions_kept(
    tmp_path: Path, layout: str, async_save: bool, memory: str
) -> None:
    results = run_distributed(
        _saves_every_step, 2, str(tmp_path), layout, async_save, memory, timeout=240
    )
    assert results[0]["steps"] == list(range(1, STEPS + 1))
    assert results[0]["differ"] == [], results[0]["differ"]
    for rank, out in enumerate(results):
        # Converted afresh at the first save; from the second on, with the plans kept, the
        # stacked layers' conversions are kept (every layout has them on every rank).
        assert out["reused"][0] == 0, (rank, out)
        assert all(n > 0 for n in out["reused"][1:]), (rank, out)


def _conversion(rank: int, world_size: int) -> dict[str, Any]:
    import gc
    import weakref

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from lightning_mcore_ckpt.engine._kept_conversions import KeptConversions

    def stacked(key: str, data: torch.Tensor, layers: int = 3) -> list[Any]:
        """A layer stack's shards, as a decoder's state dict has them (one per layer)."""
        return [
            ShardedTensor.from_rank_offsets(
                key, data[i], (0, i, layers), replica_id=0, prepend_axis_num=1
            )
            for i in range(layers)
        ]

    def state(scale: float, dtype: torch.dtype = torch.float32) -> dict[str, list[Any]]:
        weight = torch.arange(3 * 4 * 5, dtype=dtype).reshape(3, 4, 5) * scale
        return {
            "layers.w": stacked("layers.w", weight),
            "flat": [ShardedTensor.from_rank_offsets("flat", torch.ones(6) * scale)],
            "obj": [ShardedObject("obj", {"scale": scale}, (1,), (0,))],
        }

    if not dist.is_initialized():  # a one-rank run has no process group of its own
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    kept = KeptConversions()
    stock = torch_strategy.mcore_to_pyt_state_dict
    out: dict[str, Any] = {}

    first = state(1.0)
    with kept.in_use():
        converted = torch_strategy.mcore_to_pyt_state_dict(first, False)
        out["first"] = (kept.reused, kept.converted)
        out["first_shards"] = [s.tensor.clone() for s in converted["layers.w"].local_shards()]

    second = state(2.0)
    data = [sh.data for sh in second["layers.w"]]
    stack = data[0]._base  # the layers' one tensor, which each shard's data is a view of
    refs = [weakref.ref(stack), *(weakref.ref(d) for d in data)]
    with kept.in_use():
        converted = torch_strategy.mcore_to_pyt_state_dict(second, False)
        out["second"] = (kept.reused, kept.converted)
        shards = converted["layers.w"].local_shards()
        # The new data, without a copy, under the metadata made at the first save.
        out["second_is_new_data"] = [
            s.tensor.data_ptr() == d.data_ptr() for s, d in zip(shards, data, strict=True)
        ]
        out["second_values"] = [s.tensor.clone() for s in shards]
        out["offsets"] = [s.metadata.shard_offsets for s in shards]
        # Loading is Megatron-Core's own conversion.
        loading = state(3.0)
        torch_strategy.mcore_to_pyt_state_dict(loading, True)
        out["loading_left_kept"] = (kept.reused, kept.converted)
    out["stock_restored"] = torch_strategy.mcore_to_pyt_state_dict is stock
    out["kept_shards_after"] = len(converted["layers.w"].local_shards())
    del converted, shards, second, data, stack, loading
    gc.collect()
    out["let_go"] = [r() is None for r in refs]

    # Another dtype, then another shape: converted afresh, kept anew.
    with kept.in_use():
        torch_strategy.mcore_to_pyt_state_dict(state(4.0, torch.float64), False)
        out["dtype"] = (kept.reused, kept.converted)
    other = state(5.0, torch.float64)
    other["layers.w"] = stacked("layers.w", torch.zeros(4, 4, 5, dtype=torch.float64), layers=4)
    with kept.in_use():
        torch_strategy.mcore_to_pyt_state_dict(other, False)
        out["shape"] = (kept.reused, kept.converted)
    return out


def test_the_conversion_reuses_only_what_matches_and_keeps_no_data() -> None:
    (out,) = run_distributed(_conversion, 1, timeout=120)
    assert out["first"] == (0, 3)
    assert out["second"] == (1, 2)  # the stack; the plain tensor and the object afresh
    assert out["second_is_new_data"] == [True, True, True]
    for layer, value in enumerate(out["second_values"]):
        expected = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5)[layer] * 2.0
        assert torch.equal(value, expected.unsqueeze(0))
    assert out["offsets"] == [[i, 0, 0] for i in range(3)]
    assert out["loading_left_kept"] == out["second"]
    assert out["stock_restored"]
    assert out["kept_shards_after"] == 0
    assert out["let_go"] == [True, True, True, True]
    assert out["dtype"] == (0, 3)
    assert out["shape"] == (0, 3)

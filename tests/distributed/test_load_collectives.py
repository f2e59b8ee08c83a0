"""A load's collectives carry as many bytes whatever the number of tensors: no rank's sharded
metadata is gathered to every rank. (Megatron-Core's check that the ranks' shards cover every
tensor once is an all-gather of every rank's sharded tensors' metadata; at load time it checks
the structure being loaded into, which the saves of that structure check, and at 1,024 ranks
each rank would receive every rank's list. So was the record of a distributed optimizer's
parameter groups: a load maps its groups by this rank's parameters alone.)

Axes: the optimizer (torch AdamW; Megatron-Core's distributed optimizer, ``fully_reshardable``;
a mixture of experts at EP=2, whose distributed optimizer is a ``ChainedOptimizer`` of a dense
and an expert one) by the layout at load (the saving one; another: TP=2 for the dense models,
EP=1 for the mixture of experts), on 2 gloo ranks: a cell per optimizer saves a model of 2
layers and one of 6 (three times the tensors) and loads each in both layouts. In each layout
every rank asserts that its load's collectives were the same calls for both models, in which
every rank other than 0 received the same bytes (rank 0 is where megatron-core 0.16's torch
DCP load gathers the ranks' load plans: its receipts grow with the ranks, not the others'),
and that each load resumed at the saved step; that each load unpickled each of the step's
two indexes once (``safe_dcp.indexes_kept``; they were unpickled 9 times between them); and that
a torch optimizer's template agreed nothing over the ranks (its state is made from the step's
saved keys; the agreement made a rank that had read its weights wait for the slowest).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

MOE = {"num_moe_experts": 4, "moe_router_topk": 2}
OPTIMIZERS = ("adamw", "distributed", "moe")
LAYOUTS = ("same", "resharded")


def _strategy(optimizer: str, layout: str) -> Any:
    from lightning_mcore_ckpt import MegatronStrategy

    sharding = {"ckpt_optimizer_sharding": "fully_reshardable"}
    if optimizer == "moe":
        ep = 2 if layout == "same" else 1
        return MegatronStrategy(expert_model_parallel_size=ep, **sharding)
    return MegatronStrategy(tensor_model_parallel_size=1 if layout == "same" else 2, **sharding)


def _module(optimizer: str, layers: int) -> Any:
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    if optimizer == "moe":
        return TinyGPTModule(
            optimizer="distributed", num_layers=layers, dropout=0.0, transformer_config=MOE
        )
    return TinyGPTModule(optimizer=optimizer, num_layers=layers, dropout=0.0)


def _load(rank: int, world_size: int, tmp: str, optimizer: str) -> dict[str, Any]:
    from _received import record_received
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt.safety import safe_dcp

    calls: list[tuple[str, int]] = []
    on = {"load": False}
    record_received(calls, lambda: on["load"])
    indexes: list[str] = []
    load_index = safe_dcp._load_index

    def counted(f: Any, where: Any) -> Any:
        if on["load"]:
            indexes.append(f"{Path(where).parent.name}/{Path(where).name}")
        return load_index(f, where)

    safe_dcp._load_index = counted
    from lightning_mcore_ckpt.training import optim

    agreements = []
    agree = optim._agree

    def agreed(*args: Any) -> Any:
        if on["load"]:
            agreements.append(1)
        return agree(*args)

    optim._agree = agreed
    out: dict[tuple[str, int], Any] = {}
    for layers in (2, 6):
        step = str(Path(tmp, f"layers{layers}"))
        trainer = make_trainer(1, _strategy(optimizer, "same"), world_size)
        trainer.fit(_module(optimizer, layers), train_dataloaders=loader(16, 2, shuffle=True))
        trainer.save_checkpoint(step)
        trainer.strategy.teardown()
        for layout in LAYOUTS:  # each a load of the same step, in a fresh run
            strategy = _strategy(optimizer, layout)
            stock = strategy.load_checkpoint

            def load_checkpoint(*args: Any, _stock: Any = stock, **kwargs: Any) -> Any:
                on["load"] = True
                try:
                    return _stock(*args, **kwargs)
                finally:
                    on["load"] = False

            strategy.load_checkpoint = load_checkpoint
            calls.clear()
            indexes.clear()
            agreements.clear()
            trainer = make_trainer(1, strategy, world_size)
            trainer.fit(
                _module(optimizer, layers),
                train_dataloaders=loader(16, 2, shuffle=True),
                ckpt_path=step,
            )
            kinds = sorted({type(o).__name__ for o in strategy._torch_optimizers()})
            out[layout, layers] = {
                "calls": list(calls),
                "indexes": sorted(indexes),
                "agreements": len(agreements),
                "step": trainer.global_step,
                "kinds": kinds,
            }
            strategy.teardown()
    return out


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_loads_collectives_do_not_grow_with_the_number_of_tensors(
    tmp_path: Path, optimizer: str
) -> None:
    results = run_distributed(_load, 2, str(tmp_path), optimizer, timeout=280)
    for rank, out in enumerate(results):
        for layout in LAYOUTS:
            small, large = out[layout, 2], out[layout, 6]
            where = (rank, layout)
            assert small["step"] == large["step"] == 1, (where, small, large)
            assert small["calls"], (where, "no collective recorded: the recording is broken")
            # Each index unpickled once, whoever reads it: the checks (objects, shapes, the
            # optimizer's layout and keys), Megatron-Core and torch DCP.
            for got in (small, large):
                assert got["indexes"] == ["model/.metadata", "optim/.metadata"], (where, got)
                # A torch optimizer's template waits for no other rank: its state was made
                # from the step's saved keys (a rank done with its weights reads on).
                assert got["agreements"] == 0, (where, got)
            if rank == 0:  # megatron-core 0.16's DCP load gathers the ranks' plans on rank 0
                names = [n for n, _ in small["calls"]], [n for n, _ in large["calls"]]
                assert names[0] == names[1], where
            else:
                assert small["calls"] == large["calls"], (where, small["calls"], large["calls"])
    if optimizer == "moe":
        assert results[0]["same", 2]["kinds"] == ["ChainedOptimizer"], results[0]

"""The record of a distributed optimizer's parameter groups that every save writes
(``engine/_param_groups.py``, ``record``): every rank gets the same record, whole (each group's
parameters on every rank), and what a rank other than 0 receives for it does not grow with the
ranks: the ranks' lists are merged on rank 0, and only the record is broadcast.

Axes: the optimizer (Megatron-Core's distributed optimizer, one inner optimizer; a mixture of
experts' ``ChainedOptimizer`` of a dense and an expert one, experts split over every rank) by
the world (2 and 4 gloo ranks, all data-parallel, or expert-parallel over all of them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _received import assert_other_ranks_receive_alike

pytestmark = pytest.mark.timeout(300)

MOE = {"num_moe_experts": 4, "moe_router_topk": 2}


def _record_on_rank(rank: int, world: int, moe: bool) -> dict[str, Any]:
    from _received import record_received
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.engine import _param_groups
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    config = MOE if moe else None
    module = TinyGPTModule(optimizer="distributed", dropout=0.0, transformer_config=config)
    strategy = MegatronStrategy(expert_model_parallel_size=world if moe else 1)
    trainer = make_trainer(1, strategy, world)
    trainer.fit(module, train_dataloaders=loader(8 * world, 2))
    state = strategy._training_state()
    calls: list[tuple[str, int]] = []
    on = {"recording": True}
    record_received(calls, lambda: on["recording"])
    recorded = _param_groups.record(state.optimizers, state.model_sharded_state_dict)
    on["recording"] = False
    mine = _param_groups.this_ranks_groups(state.optimizers, state.model_sharded_state_dict)
    return {
        "record": recorded,
        "mine": mine,
        "calls": [name for name, _ in calls],
        "received": sum(received for _, received in calls),
        "kinds": sorted({type(o).__name__ for o in state.optimizers}),
    }


@pytest.mark.parametrize("moe", [False, True], ids=["distributed", "moe-chained"])
def test_every_rank_gets_the_whole_record_and_receives_no_more_with_more_ranks(moe: bool):
    results = {world: run_distributed(_record_on_rank, world, moe) for world in (2, 4)}
    for world, ranks in results.items():
        record = ranks[0]["record"]
        assert record, (world, ranks[0])
        for rank, result in enumerate(ranks):
            assert result["record"] == record, (world, rank)
            # Whole: each of this rank's groups is within the record's group of its position.
            for name, inners in result["mine"].items():
                for i, groups in enumerate(inners):
                    for j, keys in enumerate(groups):
                        assert set(keys) <= set(record[name][i][j]), (world, rank, name, i, j)
        if moe:
            assert ranks[0]["kinds"] == ["ChainedOptimizer"], ranks[0]
    # The record is the same at 2 and 4 ranks (the same model), and what a rank other than 0
    # receives for it too: never the other ranks' lists, whose bytes would grow with the ranks.
    assert results[2][0]["record"] == results[4][0]["record"]
    assert_other_ranks_receive_alike(results)
    assert len({tuple(r["calls"]) for ranks in results.values() for r in ranks}) == 1

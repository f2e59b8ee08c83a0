"""The agreement on the optimizer's keys at every save (``training/optim.py``, ``_agree``) on
real gloo ranks: every rank ends with the same union of every rank's findings (the first value
in rank order wins for a scalar), and what a rank other than 0 receives for it does not grow
with the ranks: it is never sent the other ranks' lists, only the union.

Axes: the ranks' findings (pipeline stages holding different keys: the gather on rank 0 and the
broadcast of the union; the same keys everywhere: the broadcast of rank 0's scalars); the world
(2 and 4 ranks, two pipeline stages each, so the union is the same at both).
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

STAGES = 2

SHARED = "decoder.layers.self_attention.linear_qkv.weight"
FIRST_ONLY = "embedding.word_embeddings.weight"
LAST_ONLY = "output_layer.weight"


def _findings(
    rank: int, world: int, stages: bool
) -> tuple[list[dict[str, Any]], set[str], set[str]]:
    """What ``rank`` finds in its optimizer: with ``stages``, what its pipeline stage holds (the
    first stage the embedding, the last the output layer and a group of its own, with an extra
    moment); the scalars' values differ on every rank, so the first in rank order must win."""
    if not stages:
        return [{"step": float(100 + rank)}], {SHARED}, {"exp_avg", "exp_avg_sq"}
    stage = rank // (world // STAGES)  # Megatron-Core's order: the pipeline rank varies slowest
    if stage == 0:
        return [{"step": float(100 + rank)}, {}], {SHARED, FIRST_ONLY}, {"exp_avg", "exp_avg_sq"}
    scalars = [{"step": float(100 + rank), "lr_scale": float(rank)}, {"step": float(200 + rank)}]
    return scalars, {SHARED, LAST_ONLY}, {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def _expected(world: int, stages: bool) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    if not stages:
        return [{"step": 100.0}], [SHARED], ["exp_avg", "exp_avg_sq"]
    first_of_last = world // STAGES  # the lowest rank of the last stage
    scalars = [
        {"step": 100.0, "lr_scale": float(first_of_last)},
        {"step": float(200 + first_of_last)},
    ]
    return (
        scalars,
        sorted({SHARED, FIRST_ONLY, LAST_ONLY}),
        ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
    )


def _agree_on_rank(rank: int, world: int, stages: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from _received import record_received

    from lightning_mcore_ckpt.training import optim

    dist.init_process_group("gloo")
    try:
        calls: list[tuple[str, int]] = []
        record_received(calls)
        scalars, stateful, names = optim._agree(*_findings(rank, world, stages))
        return {
            "agreed": (scalars, sorted(stateful), sorted(names)),
            "calls": [name for name, _ in calls],
            "received": sum(received for _, received in calls),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stages", [True, False], ids=["stages-differ", "same-keys"])
def test_every_rank_agrees_on_the_union_and_receives_no_more_with_more_ranks(stages: bool):
    results = {world: run_distributed(_agree_on_rank, world, stages) for world in (2, 4)}
    for world, ranks in results.items():
        for rank, result in enumerate(ranks):
            assert tuple(result["agreed"]) == _expected(world, stages), (world, rank)
    # A rank other than 0 receives the union (or rank 0's scalars), the same at 2 and 4 ranks:
    # never the other ranks' lists, whose bytes would grow with the ranks.
    assert_other_ranks_receive_alike(results)
    # Every rank takes part in the same collectives, at either world.
    assert len({tuple(r["calls"]) for ranks in results.values() for r in ranks}) == 1

"""Exact resume of a mixture of experts across the axes MoE users vary: every value of every
axis, and every pair of values (all-pairs, as ``test_matrix.py`` builds the dense matrix).

Each cell is one real resume check (``check_resume``) of a tiny GPT whose every layer is a
mixture of 4 experts (2 routed per token), on 2 gloo processes: the job runs uninterrupted,
then is interrupted and resumed from "last"; per-step losses, the samples every rank received,
every RNG stream, every weight (each expert on the rank that holds it), every persistent buffer
(the router's ``expert_bias``, dtype included), every optimizer tensor of every inner optimizer
(a ``ChainedOptimizer`` of a dense and an expert optimizer at EP=2), the LR schedule (linear
warmup, then cosine decay, over every inner optimizer's groups) and the loop counters must be
bit-identical at every batch, and after the last.

Axes:

- ``ep``: experts split over 1 or 2 ranks (expert parallelism);
- ``tp``: tensor parallelism 1 or 2 (with sequence parallelism, which Megatron-Core requires
  for MoE with TP > 1);
- ``etp``: each expert's tensors split over 1 or 2 ranks (expert tensor parallelism; 2 only
  with TP=2 and EP=1: 2 processes);
- ``optimizer``: torch AdamW; Megatron-Core's distributed optimizer saved ``dp_reshardable``
  and ``fully_reshardable``;
- ``async_save``: sync or async saves;
- ``interrupt``: stopped mid-epoch, at an epoch's end, or by SIGTERM;
- ``router``: the auxiliary load-balancing loss; aux-loss-free balancing with ``expert_bias``;
  a shared expert; token dropping with a capacity factor; a multi-token-prediction layer
  (built from the same local layer spec, its loss added by Megatron-Core).
- ``precision``: fp32; Megatron's bf16 (bf16 weights in ``Float16Module``, fp32 main
  parameters in the distributed optimizer: how MoE models are trained; Lightning's autocast is
  refused for MoE, ``tests/distributed/test_moe_autocast.py``).

15 cells cover every pair (router x optimizer alone has 15); a 16th keeps the cell whose first
run found the routers' token counts never reset. The precision was added to the same 16 cells,
6 of them in Megatron's bf16, every pair still covered.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import _jobs
import pytest
from _pairwise import coverage_problems

from lightning_mcore_ckpt import check_resume

AXES: dict[str, list[Any]] = {
    "ep": [1, 2],
    "tp": [1, 2],
    "etp": [1, 2],
    "optimizer": ["adamw", "distributed", "distributed_full"],
    "async_save": [False, True],
    "interrupt": ["mid_epoch", "epoch_end", "sigterm"],
    "router": ["aux_loss", "expert_bias", "shared_expert", "capacity", "mtp"],
    "precision": ["32", "megatron-bf16"],
}

EXCLUDED = [
    # An expert's tensors cannot be split over more ranks than a layer's.
    ("tp", 1, "etp", 2),
    # EP=2 x ETP=2 needs 4 processes; the cells run on 2.
    ("ep", 2, "etp", 2),
    # Megatron's mixed precision keeps its fp32 main parameters in a Megatron optimizer.
    ("precision", "megatron-bf16", "optimizer", "adamw"),
]

# fmt: off
CELLS = [
    (2, 2, 1, "distributed_full", False, "sigterm", "shared_expert", "32"),
    (1, 2, 2, "distributed", True, "epoch_end", "expert_bias", "32"),
    (1, 1, 1, "adamw", False, "mid_epoch", "capacity", "32"),
    (2, 1, 1, "distributed", True, "epoch_end", "aux_loss", "32"),
    (1, 2, 2, "adamw", True, "sigterm", "mtp", "32"),
    (1, 2, 2, "distributed_full", False, "mid_epoch", "aux_loss", "megatron-bf16"),
    (2, 1, 1, "distributed", False, "mid_epoch", "mtp", "32"),
    (2, 1, 1, "distributed_full", True, "sigterm", "expert_bias", "megatron-bf16"),
    (1, 1, 1, "adamw", False, "epoch_end", "shared_expert", "32"),
    (1, 2, 2, "distributed_full", True, "epoch_end", "capacity", "megatron-bf16"),
    (1, 2, 2, "distributed", True, "mid_epoch", "shared_expert", "megatron-bf16"),
    (2, 2, 1, "distributed", False, "sigterm", "capacity", "megatron-bf16"),
    (2, 2, 1, "adamw", False, "mid_epoch", "expert_bias", "32"),
    (2, 1, 1, "distributed_full", False, "epoch_end", "mtp", "megatron-bf16"),
    (2, 2, 1, "adamw", False, "sigterm", "aux_loss", "32"),
    # Not needed for the pairs: the cell whose first run found the routers' token counts never
    # reset (the expert bias moved differently after a resume), kept as it was.
    (2, 1, 1, "adamw", True, "sigterm", "expert_bias", "32"),
]
# fmt: on

STEPS_PER_EPOCH = 3
MAX_STEPS = 5
INTERRUPTS = {
    "mid_epoch": ("clean", 2),
    "epoch_end": ("clean", STEPS_PER_EPOCH),
    "sigterm": ("sigterm", 2),
}


def _cell(values: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(AXES, values, strict=True))


def _name(values: tuple[Any, ...]) -> str:
    cell = _cell(values)
    return "-".join(f"{k}{v}" if isinstance(v, int) else str(v) for k, v in cell.items())


def test_the_moe_cells_cover_every_pair_of_axis_values() -> None:
    assert coverage_problems(AXES, CELLS, EXCLUDED) == []


@pytest.mark.matrix
@pytest.mark.timeout(400)
@pytest.mark.parametrize("values", CELLS, ids=[_name(c) for c in CELLS])
def test_moe_resume_is_exact(tmp_path: Path, values: tuple[Any, ...]) -> None:
    cell = _cell(values)
    how, stop_at = INTERRUPTS[cell.pop("interrupt")]
    tp = cell.pop("tp")
    report = check_resume(
        functools.partial(
            _jobs.build,
            layout="tp2" if tp == 2 else "dp2",
            steps_per_epoch=STEPS_PER_EPOCH,
            scheduler="warmup_cosine",
            **cell,
        ),
        stop_at=stop_at,
        max_steps=MAX_STEPS,
        how=how,
        world_size=2,
        workdir=tmp_path / "work",
        check_determinism=False,
    )
    assert report.exact, str(report)
    (result,) = report.results
    assert result.resumed_from and result.resumed_from > 0
